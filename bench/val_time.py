#!/usr/bin/env python3
"""Validation time of the kit's Trainer.validate: one process over the whole set (what upstream's rank 0 does
while the other GPUs wait) against N processes each over its shard (distributed validation).

    [torchrun --nproc_per_node N] bench/val_time.py OUT.json TRAIN_ARGS...     (cwd: the kit tree)

Validates the EMA of --weights (or a fresh model) twice and reports the second time; rank 0 writes OUT.json.
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ddp_train_dual as dtd  # noqa: E402
from yolov9_ddp import cli, comm  # noqa: E402


def timed_validation(trainer):
    if trainer.cuda:
        torch.cuda.synchronize()
    started = time.time()
    results, _, _ = trainer.validate(trainer.ema.ema, plots=False, compute_loss=False)
    if trainer.cuda:
        torch.cuda.synchronize()
    return time.time() - started, results


def main():
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    opt = cli.parse_args(argv, ROOT)
    cli.check_options(opt, comm.launched_world_size())
    device = comm.select_device(opt.device)
    with comm.process_group(device):
        trainer = dtd.prepare_trainer(opt, device)
        first, _ = timed_validation(trainer)
        second, results = timed_validation(trainer)
        if comm.is_primary():
            out.write_text(json.dumps({'processes': trainer.world, 'images': len(trainer.val_loader.dataset),
                                       'seconds': round(second, 2), 'first_pass_s': round(first, 2),
                                       'results': [float(x) for x in results[:4]]}))


if __name__ == '__main__':
    main()
