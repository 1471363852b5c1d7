#!/usr/bin/env python3
"""What a graphed model's gradients cost the host after each backward replay: cuda_graphs' clone hook per parameter
against the lever resident_grads (the gradients zeroed in place, backward adding into them), alternated.

    python bench/grad_hooks.py OUT.json [--device cpu|cuda] [--params 897] [--elements 9804480] [--pairs 5]
                                        [--steps 40]                        (cwd: the kit tree)

A stand-in for the model's graphed forward and backward (yolov9_ddp.graphs.GraphedModel with a capture whose
backward hands out the same gradient buffers every time, as a replay does) over --params parameters holding
--elements numbers in all (yolov9-s: 897 and 9,804,480), so that only what follows the replay differs: the clones,
or the in-place adds. A step is two micro-steps (batch 32 accumulates to 64) and Trainer.zero_grad. Per side and
pair: the host's seconds a micro-step spends in backward() (the autograd thread's hooks and launches, without
waiting for the GPU) and the wall seconds a step (the GPU waited for at the end of the side).
"""
import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path.cwd()))  # the kit tree: Trainer imports upstream's modules
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from yolov9_ddp import graphs  # noqa: E402
from yolov9_ddp.levers import Levers  # noqa: E402


class ReplayedGradients(torch.autograd.Function):
    """A replay's backward: the same gradient buffers, handed out detached, every time."""

    @staticmethod
    def forward(ctx, x, buffers, *parameters):
        ctx.buffers = buffers
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad, None, *(buffer.detach() for buffer in ctx.buffers))


def stand_in(params: int, elements: int, device) -> torch.nn.Module:
    sizes = [elements // params + (k < elements % params) for k in range(params)]
    return torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes).to(device)


def replayed_capture(model, sample):
    buffers = [torch.full_like(parameter, 1e-3) for parameter in model.parameters()]
    return lambda x: ReplayedGradients.apply(x, buffers, *model.parameters())


def time_steps(forward, levers: Levers, optimizer, steps: int, cuda: bool) -> dict:
    from yolov9_ddp.trainer import Trainer
    trainer = SimpleNamespace(optimizer=optimizer, levers=levers, forward=forward)
    x, backward_s = torch.ones(8, device=optimizer.param_groups[0]['params'][0].device), 0.0
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        for _ in range(2):
            out = forward(x).sum()
            called = time.perf_counter()
            out.backward()
            backward_s += time.perf_counter() - called
        Trainer.zero_grad(trainer)
    if cuda:
        torch.cuda.synchronize()
    return {'backward_host_ms': round(backward_s / (2 * steps) * 1000, 3),
            'step_ms': round((time.perf_counter() - started) / steps * 1000, 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--params', type=int, default=897)
    p.add_argument('--elements', type=int, default=9_804_480)
    p.add_argument('--pairs', type=int, default=5)
    p.add_argument('--steps', type=int, default=40)
    args = p.parse_args()
    device, cuda = torch.device(args.device), args.device.startswith('cuda')
    sides = {}
    for name, lever in (('clones', False), ('resident', True)):
        model = stand_in(args.params, args.elements, device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0, fused=True)  # its zero_grad, as the kit's
        levers = replace(Levers(), cuda_graphs=True, resident_grads=lever)
        sides[name] = graphs.GraphedModel(model, capture=replayed_capture), levers, optimizer
        time_steps(*sides[name], 3, cuda)  # warm-up: the caching allocator, the first clones
    pairs = [{name: time_steps(*sides[name], args.steps, cuda) for name in sides} for _ in range(args.pairs)]
    medians = {name: {figure: statistics.median(pair[name][figure] for pair in pairs)
                      for figure in ('backward_host_ms', 'step_ms')} for name in sides}
    args.out.write_text(json.dumps({'device': str(device), 'torch': torch.__version__, 'params': args.params,
                                    'elements': args.elements, 'steps': args.steps, 'pairs': pairs,
                                    'medians': medians}, indent=1) + '\n')
    print(json.dumps(medians))


if __name__ == '__main__':
    main()
