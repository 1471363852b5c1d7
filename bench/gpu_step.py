#!/usr/bin/env python3
"""The kit's GPU-only training step: forward, loss, backward, optimizer step (and EMA) on a batch already on the
GPU, no loader, on one process or one per GPU (torchrun, DDP, gradient all-reduce included).

    [torchrun --nproc_per_node N] bench/gpu_step.py OUT.json [--warmup W] [--steps S] ARGS

ARGS are ddp_train_dual.py's (--data, --cfg, --batch-size for all processes, --imgsz, --device, --levers ...). Run
in the kit tree: the kit's own Trainer.train_step, with its levers (defaults, or --levers), on each rank's images
of the training set, augmented (mosaic) under fixed seeds by the run's dataset. Times `steps` steps after `warmup`
(cudnn autotuning, compilation); rank 0 writes OUT.json: img/s over all processes, and the warm-up's seconds.
"""
import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path.cwd()  # the kit tree
sys.path.insert(0, str(ROOT))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the kit's yolov9_ddp (the kit tree's own comes first)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from yolov9_ddp import cli, comm  # noqa: E402
from yolov9_ddp.tasks import TASKS  # noqa: E402

TASK = TASKS['detect-dual']  # train_dual.py's


def fixed_batch(dataset, first: int, count: int, seed: int):
    """Items first..first+count-1 of an augmenting LoadImagesAndLabels, each drawn under its own fixed seed."""
    items = []
    for index in range(first, first + count):
        random.seed(seed + index)
        np.random.seed(seed + index)
        items.append(dataset[index % len(dataset)])
    images, targets, _, _ = dataset.collate_fn(items)
    return images, targets


def synchronize(cuda: bool):
    if cuda:
        torch.cuda.synchronize()


def time_steps(step, warmup: int, steps: int, cuda: bool) -> dict:
    """Run step(i) warmup + steps times; the seconds of the warm-up and of the timed steps."""
    synchronize(cuda)
    started = time.perf_counter()
    for i in range(warmup):
        step(i)
    synchronize(cuda)
    warmed = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    synchronize(cuda)
    comm.barrier()
    return {'warmup_s': round(warmed - started, 2), 'steps_s': time.perf_counter() - warmed}


def kit_trainer(opt, device):
    """(the kit's Trainer in training mode, this rank's share of a fixed batch on the device, its targets as the
    loss takes them: Trainer.loss_targets)."""
    from yolov9_ddp.build import plan_start, prepare
    trainer = prepare(TASK, opt, device, plan_start(opt))
    per_rank = trainer.batch_size // trainer.world
    images, targets = fixed_batch(trainer.dataset, trainer.rank * per_rank, per_rank, opt.seed)
    pin = trainer.cuda  # as the kit's loader hands its batches over: page-locked, copied without a wait
    images = images.to(device, non_blocking=pin).float() / 255
    if trainer.perf.channels_last:  # as the training loop does
        images = images.contiguous(memory_format=torch.channels_last)
    trainer.model.train()
    return trainer, images, trainer.loss_targets(targets.pin_memory() if pin else targets)


def kit_step(opt, device):
    """The kit's Trainer.train_step on a fixed batch, at the iterations of its second epoch."""
    trainer, images, targets = kit_trainer(opt, device)
    return (lambda i: trainer.train_step(trainer.nb + i, 1, images, targets), len(images), trainer.world)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('--warmup', type=int, default=15)
    p.add_argument('--steps', type=int, default=40)
    args, train_args = p.parse_known_args()
    opt = cli.parse_args(train_args, ROOT, TASK)
    cli.check_options(opt, comm.launched_world_size(), TASK)
    device = comm.select_device(opt.device)
    with comm.process_group(device):
        step, per_rank, world = kit_step(opt, device)
        cuda = device.type == 'cuda'
        timing = time_steps(step, args.warmup, args.steps, cuda)
        if comm.is_primary():
            images = per_rank * world * args.steps
            args.out.write_text(json.dumps({
                'processes': world, 'batch_per_process': per_rank, 'steps': args.steps,
                'img_per_s': round(images / timing['steps_s'], 1),
                'per_gpu_img_per_s': round(images / timing['steps_s'] / world, 1), 'warmup_s': timing['warmup_s'],
                'warmup_steps': args.warmup}))


if __name__ == '__main__':
    main()
