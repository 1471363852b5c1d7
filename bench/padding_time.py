#!/usr/bin/env python3
"""The host's time for a detection loss to pad a batch's targets (ComputeLoss.preprocess of train_dual.py's loss, the
targets on the host as the lever host_targets gives them): patch 0018's whole-batch padding against the loop it
replaced, each tree timed in its own process.

    python bench/padding_time.py OUT.json OLD_TREE NEW_TREE [--pairs 5]

A batch of 32 images with 0 to 16 targets each (the bench's photographs give up to 32 a mosaic, about 8 on
average), 500 calls after 50 uncounted; the trees alternate, pair by pair.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

TIME_IN_TREE = '''
import json, sys, time
from types import SimpleNamespace
import torch
sys.path.insert(0, '.')
from utils.loss_tal_dual import ComputeLoss
g = torch.Generator().manual_seed(0)
counts = torch.randint(0, 17, (32,), generator=g)
rows = torch.cat([torch.repeat_interleave(torch.arange(32), counts).float()[:, None],
                  torch.rand(int(counts.sum()), 5, generator=g)], 1)
loss = SimpleNamespace(device=torch.device('cpu'))
for _ in range(50):
    ComputeLoss.preprocess(loss, rows, 32, torch.ones(4))
started = time.perf_counter()
for _ in range(500):
    ComputeLoss.preprocess(loss, rows, 32, torch.ones(4))
print(json.dumps({'ms_a_call': round((time.perf_counter() - started) / 500 * 1000, 4), 'targets': int(counts.sum())}))
'''


def timed(tree: Path) -> dict:
    done = subprocess.run([sys.executable, '-c', TIME_IN_TREE], cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('old', type=Path)
    p.add_argument('new', type=Path)
    p.add_argument('--pairs', type=int, default=5)
    args = p.parse_args()
    pairs = [{'old': timed(args.old), 'new': timed(args.new)} for _ in range(args.pairs)]
    ratios = sorted(pair['new']['ms_a_call'] / pair['old']['ms_a_call'] for pair in pairs)
    report = {'pairs': pairs, 'median_new_over_old': round(ratios[len(ratios) // 2], 4)}
    args.out.write_text(json.dumps(report, indent=1) + '\n')
    print(json.dumps(report))


if __name__ == '__main__':
    main()
