#!/usr/bin/env python3
"""What one periodic checkpoint costs a training thread that is bound by Python, on CPUs: written by
CheckpointWriter's thread (the default) or by its writer process (the lever checkpoint_process).

    python bench/ckpt_gil.py OUT.json [--cfg models/detect/yolov9-s.yaml] [--rounds 5] [--window-s 4]  (cwd: a kit tree)

The 'training thread' calls small torch operations in a loop for W seconds, as a loop issuing a GPU's kernels does,
and lets go of the interpreter's lock at each. In each round, alternated: a window without a checkpoint, one in which
the thread queues a checkpoint of the model (channels-last), its EMA and the SGD state and the writer's thread writes
it, and one with a (warm) writer process. The cost of a checkpoint is the calls the loop lost against the round's
window without one, in seconds of that window's rate. The writer's CPU and the loop share the machine's cores, as on a
GPU machine the loader's workers do.
"""
import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from yolov9_ddp import checkpoint, checkpoint_process  # noqa: E402


def training_state(cfg: str) -> dict:
    from models.yolo import Model
    model = Model(cfg, ch=3, nc=80).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    return {'epoch': 1, 'model': model, 'ema': copy.deepcopy(model), 'optimizer': optimizer.state_dict(),
            'scaler': {}}


def loop_calls(seconds: float) -> int:
    x, calls, end = torch.ones(8), 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        x.add_(1).mul_(0.5)
        calls += 1
    return calls


def window(writer, state: dict, path: Path, seconds: float) -> dict:
    """The loop's calls in a window of `seconds` that starts with a checkpoint (none without a writer)."""
    started = time.perf_counter()
    if writer is not None:
        writer.submit(lambda: checkpoint.QueuedCheckpoint(state), path, 'checkpoint')
    calls = loop_calls(seconds - (time.perf_counter() - started))
    written_in_window = writer is None or not writer.running
    if writer is not None:
        writer.wait()
    return {'calls': calls, 'written_in_window': written_in_window}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('--cfg', default='models/detect/yolov9-s.yaml')
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--window-s', type=float, default=4.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    state = training_state(args.cfg)
    folder = Path(tempfile.mkdtemp(prefix='ckpt-gil-'))
    writers = {'thread': checkpoint.CheckpointWriter(print),
               'process': checkpoint.CheckpointWriter(print, checkpoint_process.WriterProcess(print))}
    writers['process'].submit(lambda: checkpoint.QueuedCheckpoint(state), folder / 'warm.pt', 'warm-up')
    writers['process'].wait()  # a run starts the process as it sets up; its checkpoints find it warm
    rounds = []
    for _ in range(args.rounds):
        none = window(None, state, folder / 'none.pt', args.window_s)
        rate = none['calls'] / args.window_s
        row = {'none_calls': none['calls']}
        for way, writer in writers.items():
            result = window(writer, state, folder / f'{way}.pt', args.window_s)
            row[f'{way}_lost_s'] = round((none['calls'] - result['calls']) / rate, 3)
            row[f'{way}_written_in_window'] = result['written_in_window']
        rounds.append(row)
        print(json.dumps(row), flush=True)
    for writer in writers.values():
        writer.close()
    summary = {f'{way}_lost_s_median': statistics.median(r[f'{way}_lost_s'] for r in rounds) for way in writers}
    args.out.write_text(json.dumps({'cfg': args.cfg, 'window_s': args.window_s, 'torch': torch.__version__,
                                    'rounds': rounds, **summary}, indent=1) + '\n')
    print(json.dumps(summary))


if __name__ == '__main__':
    main()
