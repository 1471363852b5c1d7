#!/usr/bin/env python3
"""What a checkpoint written in a background thread costs a training-like thread in the same process, with the
interpreter's lock handed over every 5 ms (Python's default) or every checkpoint.WRITING_SWITCH_INTERVAL_S (CPUs).

    python bench/gil_convoy.py OUT.json [--pairs P] [--seconds S]

The training-like thread does what the kit's training thread does between the GPU's waits: small torch calls, each
of which lets go of the lock, then a wait of 1 ms with the lock released (a GPU sync). The writer's thread torch.saves
a checkpoint-like state (two models of 1,000 small modules, 4,000 tensors) into memory, again and again. A pair is
(the training-like thread's rate beside the writer / alone) at each interval, alternated P times; every pair is
recorded.
"""
import argparse
import io
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from yolov9_ddp.checkpoint import WRITING_SWITCH_INTERVAL_S, switch_interval  # noqa: E402

DEFAULT_S = sys.getswitchinterval()


def checkpoint_like() -> dict:
    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)) for _ in range(500)])
    return {'model': model, 'ema': nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))
                                                   for _ in range(500)])}


def steps(seconds: float) -> float:
    """Steps a second: 20 small torch calls, then a 1 ms wait without the lock."""
    x, done, end = torch.ones(64), 0, time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < end:
        for _ in range(20):
            x = x.mul(0.5).add(1)
        time.sleep(0.001)
        done += 1
    return done / (time.perf_counter() - started)


def rate(interval: float, state, seconds: float, beside_writer: bool) -> float:
    stop = threading.Event()

    def write():
        while not stop.is_set():
            torch.save(state, io.BytesIO())
    writer = threading.Thread(target=write)
    with switch_interval(interval):
        if beside_writer:
            writer.start()
        try:
            return steps(seconds)
        finally:
            stop.set()
            if beside_writer:
                writer.join()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('--pairs', type=int, default=3)
    p.add_argument('--seconds', type=float, default=3.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    state, pairs = checkpoint_like(), []
    for _ in range(args.pairs):
        pair = {}
        for interval in (DEFAULT_S, WRITING_SWITCH_INTERVAL_S):
            alone = rate(interval, state, args.seconds, False)
            beside = rate(interval, state, args.seconds, True)
            pair[f'{interval * 1000:g} ms'] = {'alone': round(alone, 1), 'beside_writer': round(beside, 1),
                                               'ratio': round(beside / alone, 3)}
        pairs.append(pair)
        print(json.dumps(pair), flush=True)
    medians = {key: statistics.median(pair[key]['ratio'] for pair in pairs) for key in pairs[0]}
    args.out.write_text(json.dumps({'pairs': pairs, 'median_ratio': medians, 'cpus': len(
        __import__('os').sched_getaffinity(0)), 'torch': torch.__version__}, indent=1) + '\n')
    print(json.dumps(medians))


if __name__ == '__main__':
    main()
