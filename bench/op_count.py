#!/usr/bin/env python3
"""How many operators the host dispatches in each part of the kit's training step: the model's forward, the loss,
backward (the loss's and the model's, and the gradients' clones under cuda_graphs), the optimizer step and the EMA.
Each is a call through torch's dispatcher, most of them a kernel launch on a GPU; under cuda_graphs the model's
forward and backward are one replay each instead.

    python bench/op_count.py OUT.json [--steps S] ARGS                 (cwd: the kit tree, one process)

ARGS are ddp_train_dual.py's (--data, --cfg, --batch-size, --imgsz, --device, --levers ...). The step is
gpu_step.py's (Trainer.train_step on a fixed batch, at the iterations of the second epoch), counted over S
micro-steps after 3 uncounted ones. On CPUs the optimizer's and the gradient clipping's operators go one tensor at a
time (torch's multi-tensor kernels are for GPUs), so there its count is the parameters' number several times over.
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the kit tree
sys.path.append(str(Path(__file__).resolve().parents[1]))

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.gpu_step import TASK, kit_trainer  # noqa: E402
from yolov9_ddp import cli, comm  # noqa: E402

AFTER = {'loss': 'backward'}  # what a part's end starts: the step goes on to backward after the loss


class Census(TorchDispatchMode):
    """Counts each dispatched operator under the part of the step that is running."""

    def __init__(self):
        super().__init__()
        self.part, self.counts = 'other', Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.part] += 1
        return func(*args, **(kwargs or {}))

    def labelled(self, part: str, function):
        def counted(*args, **kwargs):
            outer, self.part = self.part, part
            try:
                return function(*args, **kwargs)
            finally:
                self.part = AFTER.get(part, outer)
        return counted


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('--steps', type=int, default=4)
    args, train_args = p.parse_known_args()
    opt = cli.parse_args(train_args, Path.cwd(), TASK)
    cli.check_options(opt, 1, TASK)
    device = comm.select_device(opt.device)
    with comm.process_group(device):
        trainer, images, targets = kit_trainer(opt, device)
        census = Census()
        for part, name in (('model forward', 'forward'), ('loss', 'compute_loss'), ('optimizer step', 'optimizer_step'),
                           ('EMA', 'update_ema')):
            setattr(trainer, name, census.labelled(part, getattr(trainer, name)))
        step = trainer.nb + 200  # past the warm-up: the accumulation of batch 64
        for i in range(3):
            trainer.train_step(step + i, 1, images, targets)
        with census:
            for i in range(3, 3 + args.steps):
                census.part = 'other'
                trainer.train_step(step + i, 1, images, targets)
        per_step = {part: round(count / args.steps, 1) for part, count in census.counts.most_common()}
        report = {'device': str(device), 'levers': opt.levers, 'accumulate': int(trainer.accumulate),
                  'parameters': sum(1 for _ in trainer.model.parameters()), 'micro_steps': args.steps,
                  'operators_a_micro_step': per_step}
        args.out.write_text(json.dumps(report, indent=1) + '\n')
        print(json.dumps(report))


if __name__ == '__main__':
    main()
