#!/usr/bin/env python3
"""Validation time, alternated in one job: rank-0 validation (rank 0 validates the whole set while the other
ranks wait, as upstream's train_dual.py does) against distributed validation (every rank its shard, statistics
gathered, as the kit does).

    torchrun --nproc_per_node N bench/val_time.py OUT.json [--pairs P] TRAIN_ARGS...     (cwd: the kit tree)

Validates the EMA of a freshly set-up Trainer (or of --weights) once each way untimed, then P pairs (rank-0,
distributed) timed; both ways use the same per-process batch and loader workers. Rank 0 writes OUT.json: every
pair's seconds and metrics (P, R, mAP50, mAP50-95) and the largest metric difference between the two ways.
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from utils.dataloaders import LoadImagesAndLabels  # noqa: E402
from yolov9_ddp import cli, comm, data  # noqa: E402
from yolov9_ddp.samplers import ShardBatchSampler  # noqa: E402
from yolov9_ddp.tasks import TASKS  # noqa: E402
from yolov9_ddp.build import plan_start, prepare  # noqa: E402

TASK = TASKS['detect-dual']  # train_dual.py's: val_dual.py validates


def whole_set_loader(trainer):
    """The validation set in one process's batches, with the loader workers a rank has."""
    dataset, batch = trainer.val_loader.dataset, trainer.batch_size // trainer.world * 2
    return data.make_loader(dataset, ShardBatchSampler(len(dataset), batch, 0, 1), trainer.val_loader.num_workers,
                            trainer.cuda, LoadImagesAndLabels.collate_fn)


def rank0_validation(trainer, loader):
    """Rank 0 validates every image, the others wait (train_dual.py's way); the metrics, on rank 0."""
    results = None
    if trainer.primary:
        results, _, _ = TASK.validate(data=trainer.data_dict, batch_size=trainer.batch_size // trainer.world * 2,
                                      imgsz=trainer.imgsz, half=trainer.amp, model=trainer.ema.ema,
                                      single_cls=trainer.opt.single_cls, dataloader=loader,
                                      save_dir=trainer.save_dir, plots=False, compute_loss=None, distributed=False)
    comm.barrier()
    return results


def distributed_validation(trainer):
    results, _, _ = trainer.validate(trainer.ema.ema, plots=False, compute_loss=False)
    return results


def timed(validate, cuda):
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    results = validate()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started, [float(x) for x in results[:4]] if results is not None else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('--pairs', type=int, default=3)
    args, train_args = p.parse_known_args()
    opt = cli.parse_args(train_args, ROOT, TASK)
    cli.check_options(opt, comm.launched_world_size(), TASK)
    device = comm.select_device(opt.device)
    with comm.process_group(device):
        trainer = prepare(TASK, opt, device, plan_start(opt))
        loader = whole_set_loader(trainer)
        ways = {'rank0': lambda: rank0_validation(trainer, loader),
                'distributed': lambda: distributed_validation(trainer)}
        first = {way: timed(validate, trainer.cuda)[0] for way, validate in ways.items()}  # warm-up
        pairs = []
        for _ in range(args.pairs):
            (rank0_s, rank0), (distributed_s, distributed) = (timed(v, trainer.cuda) for v in ways.values())
            pairs.append({'rank0_s': round(rank0_s, 3), 'distributed_s': round(distributed_s, 3),
                          'rank0_metrics': rank0, 'distributed_metrics': distributed,
                          'max_metric_difference': max(abs(a - b) for a, b in zip(rank0, distributed))
                          if trainer.primary else None})
        if trainer.primary:
            args.out.write_text(json.dumps({'processes': trainer.world, 'images': len(loader.dataset),
                                            'first_pass_s': {k: round(v, 2) for k, v in first.items()},
                                            'pairs': pairs}))


if __name__ == '__main__':
    main()
