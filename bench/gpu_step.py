#!/usr/bin/env python3
"""The GPU-only step ceiling: forward, loss, backward and optimizer step under AMP on a batch already on the GPU.

Run from a patched YOLOv9 tree with the kit installed (it imports upstream's model and loss, and the kit's
fused_optimizer). Prints one JSON line with img/s for upstream's settings (deterministic algorithms, NCHW,
foreach SGD), then adding cudnn autotuning, the fused SGD and channels-last one after the other.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')  # what upstream's init_seeds sets for determinism
sys.path.insert(0, str(Path.cwd()))

import torch  # noqa: E402
import yaml  # noqa: E402

from models.yolo import Model  # noqa: E402
from utils.loss_tal_dual import ComputeLoss  # noqa: E402
from utils.torch_utils import smart_optimizer  # noqa: E402
from yolov9_ddp.levers import fused_optimizer  # noqa: E402

CONFIGS = {'upstream': dict(benchmark=False, channels_last=False, fused=False),
           'cudnn_benchmark': dict(benchmark=True, channels_last=False, fused=False),
           'cudnn_benchmark+fused': dict(benchmark=True, channels_last=False, fused=True),
           'cudnn_benchmark+fused+channels_last': dict(benchmark=True, channels_last=True, fused=True)}


def fixed_batch(batch, imgsz, boxes=6):
    images = torch.rand(batch, 3, imgsz, imgsz, device='cuda')
    rows = []
    for i in range(batch):
        xy, wh = torch.rand(boxes, 2) * 0.6 + 0.2, torch.rand(boxes, 2) * 0.2 + 0.05
        rows.append(torch.cat([torch.full((boxes, 1), float(i)), torch.randint(0, 3, (boxes, 1)).float(), xy, wh], 1))
    return images, torch.cat(rows).cuda()


def step_rate(cfg, batch, imgsz, benchmark, channels_last, fused, warmup=15, steps=40):
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cudnn.deterministic = not benchmark
    torch.use_deterministic_algorithms(not benchmark)
    model = Model(cfg, ch=3, nc=3).cuda().train()
    model.hyp = yaml.safe_load(Path('data/hyps/hyp.scratch-high.yaml').read_text())
    loss_fn = ComputeLoss(model)
    if channels_last:  # before the optimizer: fused SGD needs its buffers in the weights' layout
        model.to(memory_format=torch.channels_last)
    optimizer = smart_optimizer(model, 'SGD', 0.01, 0.937, 5e-4)
    if fused:
        optimizer = fused_optimizer(optimizer)
    scaler = torch.amp.GradScaler('cuda')
    images, targets = fixed_batch(batch, imgsz)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            started = time.time()
        with torch.amp.autocast('cuda'):
            loss, _ = loss_fn(model(images), targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    return round(batch * steps / (time.time() - started), 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--cfg', default='models/detect/yolov9-s.yaml')
    p.add_argument('--batch', type=int, default=32)
    p.add_argument('--imgsz', type=int, default=640)
    args = p.parse_args()
    rates = {name: step_rate(args.cfg, args.batch, args.imgsz, **config) for name, config in CONFIGS.items()}
    print(json.dumps({'batch': args.batch, 'imgsz': args.imgsz, 'img_per_s': rates}))


if __name__ == '__main__':
    main()
