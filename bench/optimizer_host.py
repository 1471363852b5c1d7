#!/usr/bin/env python3
"""The host's time for the kit's optimizer step (Trainer.optimizer_step) over yolov9-s's parameters, by part: what
bf16 without the GradScaler could save at most (the scaler's own work), and what a step without its per-parameter
Python loops (a flat gradient buffer, or the step in a CUDA graph) could save at most (all of it).

    python bench/optimizer_host.py OUT.json [--cfg models/detect/yolov9-s.yaml] [--steps 300] [--accumulate 2]
                                                                                   (cwd: the kit tree)

The parameters are stand-ins of one element each, in the parameter groups smart_optimizer makes of the real model,
so that the time is the host's (Python and dispatch), not the arithmetic; the optimizer is the kit's fused SGD on
CPUs, the scaler torch's GradScaler. Each optimizer step follows `accumulate` scaled losses (batch 32: 2), as in
training; 30 uncounted steps first.
"""
import argparse
import collections
import functools
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path.cwd()))  # the kit tree
sys.path.append(str(Path(__file__).resolve().parents[1]))

from models.yolo import Model  # noqa: E402
from utils.torch_utils import ModelEMA, smart_optimizer  # noqa: E402

from yolov9_ddp.ema import EmaUpdater  # noqa: E402
from yolov9_ddp.levers import Levers, fused_optimizer  # noqa: E402
from yolov9_ddp.trainer import Trainer  # noqa: E402

spent = collections.Counter()


def timed(name: str, function):
    @functools.wraps(function)
    def measured(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - started
    return measured


def stand_in_model(cfg: str) -> torch.nn.Module:
    """A module with one one-element parameter for each of the model's, in smart_optimizer's groups."""
    model = Model(cfg, ch=3, nc=80)
    real = smart_optimizer(model, 'SGD', 0.01, 0.937, 0.0005)
    stand_in = torch.nn.Module()
    stand_in.groups = torch.nn.ModuleList()
    for group in real.param_groups:
        holder = torch.nn.Module()
        holder.values = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(1)) for _ in group['params'])
        holder.weight_decay = group['weight_decay']
        stand_in.groups.append(holder)
    return stand_in


def stand_in_trainer(model: torch.nn.Module, accumulate: int) -> SimpleNamespace:
    groups = [{'params': list(holder.values), 'weight_decay': holder.weight_decay} for holder in model.groups]
    optimizer = fused_optimizer(torch.optim.SGD(groups, lr=0.01, momentum=0.937, nesterov=True))
    optimizer.step = timed('optimizer.step', optimizer.step)
    scaler = torch.amp.GradScaler('cpu')
    for name in ('scale', 'unscale_', 'step', 'update'):
        setattr(scaler, name, timed(f'scaler.{name}', getattr(scaler, name)))
    trainer = SimpleNamespace(model=model, optimizer=optimizer, scaler=scaler, levers=Levers(), accumulate=accumulate)
    trainer.zero_grad = timed('zero_grad', functools.partial(Trainer.zero_grad, trainer))
    trainer.update_ema = timed('ema', EmaUpdater(ModelEMA(model), model, foreach=True))
    return trainer


def optimizer_steps(trainer, steps: int):
    loss = torch.ones(1, requires_grad=True)
    parameters = list(trainer.model.parameters())
    for _ in range(steps):
        for _ in range(trainer.accumulate):
            trainer.scaler.scale(loss)
        for p in parameters:  # what backward leaves
            p.grad = torch.ones(1)
        timed('optimizer_step', Trainer.optimizer_step)(trainer)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('--cfg', default='models/detect/yolov9-s.yaml')
    p.add_argument('--steps', type=int, default=300)
    p.add_argument('--accumulate', type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    trainer = stand_in_trainer(stand_in_model(args.cfg), args.accumulate)
    torch.nn.utils.clip_grad_norm_ = timed('clip_grad_norm_', torch.nn.utils.clip_grad_norm_)
    optimizer_steps(trainer, 30)
    spent.clear()
    optimizer_steps(trainer, args.steps)
    ms = {name: round(seconds / args.steps * 1000, 3) for name, seconds in spent.most_common()}
    scaler_own = ms['scaler.scale'] + ms['scaler.unscale_'] + ms['scaler.update'] + ms['scaler.step'] - \
        ms['optimizer.step']
    report = {'parameters': sum(1 for _ in trainer.model.parameters()), 'accumulate': args.accumulate,
              'ms_an_optimizer_step': ms, 'ms_of_the_scaler_itself': round(scaler_own, 3),
              'torch': torch.__version__}
    args.out.write_text(json.dumps(report, indent=1) + '\n')
    print(json.dumps(report))


if __name__ == '__main__':
    main()
