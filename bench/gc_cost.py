#!/usr/bin/env python3
"""What a full garbage collection costs a training process once it is set up: with the set-up's objects frozen, as
the Trainer leaves them (trainer.freeze_long_lived_objects), and with them collectable again.

    python bench/gc_cost.py OUT.json ARGS       (cwd: the kit tree; ARGS are ddp_train_dual.py's)

Writes the training images, the objects the collector tracks (and has frozen), and the fastest of 3 full collections
each way. A checkpoint's copy makes tens of thousands of objects, enough to set off a full collection, which holds
the GIL: every thread of the process waits for it (bench/RESULTS.md).
"""
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.gpu_step import TASK, kit_trainer  # noqa: E402
from yolov9_ddp import cli, comm  # noqa: E402


def full_collection_s(repeats=3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    return round(min(times), 4)


def main():
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    opt = cli.parse_args(argv, ROOT, TASK)
    device = comm.select_device(opt.device)
    with comm.process_group(device):
        trainer, _, _ = kit_trainer(opt, device)
        frozen = {'frozen': gc.get_freeze_count(), 'tracked': len(gc.get_objects()),
                  'full_collection_s': full_collection_s()}
        gc.unfreeze()
        collectable = {'tracked': len(gc.get_objects()), 'full_collection_s': full_collection_s()}
        out.write_text(json.dumps({'images': len(trainer.dataset), 'frozen': frozen, 'not_frozen': collectable}))


if __name__ == '__main__':
    main()
