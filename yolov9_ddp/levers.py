"""Performance levers of the training loop, measured on 2 x H200 by bench/run_bench.py (bench/RESULTS.md).

The defaults are the settings of the kit's measured runs: cudnn autotuning instead of upstream's deterministic
algorithms (faster in both lever runs), the fused SGD, and the levers that only move data or launch fewer
kernels. --channels-last and --compile are command-line flags; every lever can also be set through
YOLOV9_DDP_LEVERS="name=value,..." (used by bench/run_bench.py to switch one lever at a time and measure what
it is worth).
"""
import os
from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class Levers:
    pin_memory: bool = True  # page-locked batches, copied to the GPU with non_blocking=True (no host sync)
    persistent_workers: bool = True  # loader workers live across epochs instead of being re-forked
    prefetch_factor: int = 4  # batches each loader worker keeps ready
    fused_optimizer: bool = True  # one fused kernel per parameter group; with AMP also no found_inf .item() sync
    foreach_ema: bool = True  # EMA update as a few multi-tensor kernels instead of two kernels per tensor
    bucket_view: bool = True  # DDP gradient_as_bucket_view: gradients live in the all-reduce buckets (no copy)
    static_graph: bool = False  # DDP static_graph (see yolov9#559: breaks models with unused parameters)
    progress_every: int = 10  # steps between progress-bar updates (formatting the losses syncs with the GPU)
    cudnn_benchmark: bool = True  # autotuned convolutions instead of upstream's deterministic algorithms
    channels_last: bool = False  # NHWC tensors for the convolutions (--channels-last)
    compile: bool = False  # torch.compile the model (--compile)


def parse_overrides(text: str) -> dict:
    """'name=value,...' -> {name: typed value}; an unknown name or a bad value raises ValueError."""
    known = {f.name: f.type for f in fields(Levers)}
    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(','))):
        name, _, value = item.partition('=')
        if name not in known:
            raise ValueError(f'YOLOV9_DDP_LEVERS: unknown lever {name!r} (known: {", ".join(known)})')
        if known[name] in (bool, 'bool'):
            if value not in ('0', '1'):
                raise ValueError(f'YOLOV9_DDP_LEVERS: {name} takes 0 or 1, not {value!r}')
            overrides[name] = value == '1'
        else:
            overrides[name] = int(value)
    return overrides


def levers_for(opt) -> Levers:
    levers = replace(Levers(), channels_last=opt.channels_last, compile=opt.compile)
    return replace(levers, **parse_overrides(os.environ.get('YOLOV9_DDP_LEVERS', '')))


def fused_optimizer(optimizer):
    """The same optimizer with fused kernels: one launch per parameter group, and no found_inf sync in GradScaler.

    torch's fused SGD allocates its momentum buffers uninitialised (torch.empty_like) and fills them in its first
    step. Under AMP that first step is often skipped (gradient overflow at the initial scale), and the buffers
    then stay garbage: the next step writes NaN into the weights. Zero buffers, created here, make the first
    real step exactly the step of the unfused optimizer (buffer = momentum * 0 + gradient).
    """
    implementation = ('foreach', 'fused', 'differentiable')
    groups = [{k: v for k, v in group.items() if k not in implementation} for group in optimizer.param_groups]
    defaults = {k: v for k, v in optimizer.defaults.items() if k not in implementation}
    fused = type(optimizer)(groups, **defaults, fused=True)
    if isinstance(fused, torch.optim.SGD):
        for group in fused.param_groups:
            if group['momentum']:
                for p in group['params']:
                    fused.state[p]['momentum_buffer'] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return fused
