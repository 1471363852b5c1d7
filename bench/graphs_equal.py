#!/usr/bin/env python3
"""Does the lever cuda_graphs change the arithmetic? Two micro-steps (forward, loss, backward; gradients
accumulated) of the kit's trainer on a fixed batch, eager twice and graphed twice from the same weights and
BatchNorm statistics, --deterministic: which model outputs and parameter gradients differ, and by how much.

    cd KIT_TREE && python bench/graphs_equal.py OUT.json ARGS      ARGS: ddp_train_dual.py's (--data, --cfg, ...)
"""
import copy
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from gpu_step import TASK, kit_trainer  # noqa: E402
from yolov9_ddp import cli, comm, graphs  # noqa: E402
from yolov9_ddp.levers import CUBLAS_WORKSPACE  # noqa: E402


def micro_steps(trainer, forward, state, images, targets, count=2):
    """count micro-steps accumulating their gradients, from the weights and statistics of state."""
    trainer.raw_model.load_state_dict(state)
    trainer.optimizer.zero_grad()
    for flipped in range(count):
        batch = images.flip(-1) if flipped % 2 else images  # another batch of the same shape
        with torch.amp.autocast('cuda', cache_enabled=False):
            pred = forward(batch)
            loss, _ = trainer.compute_loss(pred, targets)
        loss.backward()  # unscaled: GradScaler's first scale overflows the first layers' gradients (NaN)
    grads = {n: p.grad.detach().clone() for n, p in trainer.raw_model.named_parameters() if p.grad is not None}
    return [t.detach().clone() for t in tree_leaves(pred)], grads


def compare(a, b) -> dict:
    outputs = [i for i, (x, y) in enumerate(zip(a[0], b[0])) if not torch.equal(x, y)]
    grads = [n for n in a[1] if not torch.equal(a[1][n], b[1][n])]
    worst = max(((a[1][n] - b[1][n]).abs().max().item() / max(a[1][n].abs().max().item(), 1e-30), n)
                for n in grads) if grads else None
    return {'outputs_differing': outputs, 'grads_differing': len(grads), 'of': len(a[1]),
            'first_differing': grads[:3], 'last_differing': grads[-3:], 'worst_relative': worst}


def main():
    out, args = Path(sys.argv[1]), sys.argv[2:]
    opt = cli.parse_args([*args, '--deterministic'], Path.cwd(), TASK)
    cli.check_options(opt, 1, TASK)
    os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', CUBLAS_WORKSPACE)  # before CUDA starts, as entry.py
    device = comm.select_device(opt.device)
    with comm.process_group(device):
        trainer, images, targets = kit_trainer(opt, device)
        state = copy.deepcopy(trainer.raw_model.state_dict())
        eager = [micro_steps(trainer, trainer.raw_model, state, images, targets) for _ in range(2)]
        graphed_model = graphs.GraphedModel(trainer.raw_model)
        graphed = [micro_steps(trainer, graphed_model, state, images, targets) for _ in range(2)]
        report = {'eager_vs_eager': compare(*eager), 'graphed_vs_graphed': compare(*graphed),
                  'eager_vs_graphed': compare(eager[0], graphed[0])}
    print(json.dumps(report, indent=1))
    out.write_text(json.dumps(report, indent=1))


if __name__ == '__main__':
    main()
