#!/usr/bin/env python3
"""The GPU-only training step: forward, loss, backward, optimizer step (and EMA) on a batch already on the GPU,
no loader, on one process or one per GPU (torchrun, DDP, gradient all-reduce included).

    [torchrun --nproc_per_node N] bench/gpu_step.py OUT.json --settings kit|upstream [--warmup W] [--steps S] ARGS

ARGS are ddp_train_dual.py's (--data, --cfg, --batch-size for all processes, --imgsz, --device, --levers ...).
  kit        run in the kit tree: the kit's own Trainer.train_step, with its levers (defaults, or --levers)
  upstream   run in the upstream tree: train_dual.py's step as upstream writes it, with its settings (deterministic
             algorithms, NCHW, foreach SGD, DDP with static_graph and buffer broadcasts, the EMA on rank 0 only)

Both take the same batch: each rank's images of the training set, augmented (mosaic) under fixed seeds by
upstream's LoadImagesAndLabels. Times `steps` steps after `warmup` (cudnn autotuning, compilation); rank 0
writes OUT.json: img/s over all processes, and the warm-up's seconds.
"""
import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path.cwd()  # the kit tree or the upstream tree
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


def upstream_step(opt, device):
    """train_dual.py's step (its loop body from warmup to the EMA update) with its settings, on a fixed batch."""
    import yaml
    from torch.nn.parallel import DistributedDataParallel
    from models.yolo import Model
    from utils.dataloaders import LoadImagesAndLabels
    from utils.general import check_dataset, init_seeds
    from utils.loss_tal_dual import ComputeLoss
    from utils.torch_utils import ModelEMA, smart_DDP, smart_optimizer
    rank, world, cuda = comm.get_rank(), comm.get_world_size(), device.type == 'cuda'
    init_seeds(opt.seed + 1 + rank, deterministic=True)
    hyp = yaml.safe_load(Path(opt.hyp).read_text())
    data = check_dataset(opt.data)
    model = Model(opt.cfg, ch=3, nc=int(data['nc']), anchors=hyp.get('anchors')).to(device)
    gs = max(int(model.stride.max()), 32)
    batch, nbs = opt.batch_size, 64
    accumulate = max(round(nbs / batch), 1)
    hyp['weight_decay'] *= batch * accumulate / nbs
    optimizer = smart_optimizer(model, opt.optimizer, hyp['lr0'], hyp['momentum'], hyp['weight_decay'])
    lf = lambda x: (1 - x / opt.epochs) * (1.0 - hyp['lrf']) + hyp['lrf']  # noqa: E731  (upstream's linear LR)
    for group in optimizer.param_groups:
        group['initial_lr'] = group['lr']
    ema = ModelEMA(model) if rank == 0 else None
    per_rank = batch // world
    dataset = LoadImagesAndLabels(data['train'], opt.imgsz, per_rank, augment=True, hyp=hyp, stride=gs)
    if world > 1:  # upstream wraps in DDP on CUDA only (smart_DDP); on CPUs (a dry run) the same wrapper, gloo
        model = smart_DDP(model) if cuda else DistributedDataParallel(model, static_graph=True)
    model.nc, model.hyp, model.names = int(data['nc']), {**hyp, 'anchor_t': 5.0, 'label_smoothing': 0.0}, data['names']
    compute_loss = ComputeLoss(model)
    scaler = torch.amp.GradScaler('cuda', enabled=cuda)
    images, targets = fixed_batch(dataset, rank * per_rank, per_rank, opt.seed)
    images, targets = images.to(device).float() / 255, targets.to(device)
    nb = (len(dataset) + batch - 1) // batch
    nw = max(round(hyp['warmup_epochs'] * nb), 100)
    state = {'accumulate': accumulate, 'last_opt_step': -1}
    model.train()

    def step(i):
        ni = nb + i  # the second epoch, as the kit's step
        if ni <= nw:
            state['accumulate'] = max(1, np.interp(ni, [0, nw], [1, nbs / batch]).round())
            for j, group in enumerate(optimizer.param_groups):
                group['lr'] = np.interp(ni, [0, nw], [hyp['warmup_bias_lr'] if j == 0 else 0.0,
                                                      group['initial_lr'] * lf(1)])
                if 'momentum' in group:
                    group['momentum'] = np.interp(ni, [0, nw], [hyp['warmup_momentum'], hyp['momentum']])
        with torch.amp.autocast('cuda', enabled=cuda):
            loss, _ = compute_loss(model(images), targets)
            if world > 1:
                loss *= world
        scaler.scale(loss).backward()
        if ni - state['last_opt_step'] >= state['accumulate']:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if ema:
                ema.update(model)
            state['last_opt_step'] = ni
    return step, per_rank, world


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('--settings', choices=('kit', 'upstream'), required=True)
    p.add_argument('--warmup', type=int, default=15)
    p.add_argument('--steps', type=int, default=40)
    args, train_args = p.parse_known_args()
    if args.settings == 'upstream':
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')  # what upstream's init_seeds sets, before cuBLAS
    opt = cli.parse_args(train_args, ROOT, TASK)
    cli.check_options(opt, comm.launched_world_size(), TASK)
    device = comm.select_device(opt.device)
    with comm.process_group(device):
        step, per_rank, world = (kit_step if args.settings == 'kit' else upstream_step)(opt, device)
        cuda = device.type == 'cuda'
        timing = time_steps(step, args.warmup, args.steps, cuda)
        if comm.is_primary():
            images = per_rank * world * args.steps
            args.out.write_text(json.dumps({
                'settings': args.settings, 'processes': world, 'batch_per_process': per_rank, 'steps': args.steps,
                'img_per_s': round(images / timing['steps_s'], 1),
                'per_gpu_img_per_s': round(images / timing['steps_s'] / world, 1), 'warmup_s': timing['warmup_s'],
                'warmup_steps': args.warmup}))


if __name__ == '__main__':
    main()
