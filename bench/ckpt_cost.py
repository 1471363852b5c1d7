#!/usr/bin/env python3
"""What a periodic checkpoint (--checkpoint-steps/--checkpoint-minutes) costs the training thread, part by part, on
the GPU-only step of bench/gpu_step.py (the kit's Trainer.train_step on a fixed batch, no loader).

    python bench/ckpt_cost.py OUT.json [--pairs P] [--steps S] [--every K] ARGS      (cwd: the kit tree)

ARGS are ddp_train_dual.py's. Rank 0's part of a checkpoint is queue_host_checkpoint() (checkpoint.QueuedHostCopy:
the state pickled in memory with every tensor's copy to the host queued) and a CheckpointWriter.submit() (the copy
completed and torch.save in a background thread, which shares the interpreter with the training thread); the
parts' host_checkpoint_s is the two halves in a row. The parts are timed alone (median of
5): the pickling with the tensors left where they are, the copies to the host one tensor at a time (blocking),
the same copies queued without blocking and waited for once, one copy for each dtype's tensors (QueuedHostCopy's way)
and torch.save of a host copy. Then P alternating
rounds of S steps without a checkpoint, with one every K steps, and with one every K steps written by torch.save
given the file's name (save_atomic gives it an open file object): the cost per checkpoint is the difference to the
round without, over the checkpoints taken; one_a_minute_ratio is what that cost makes of a
checkpoint a minute (60 / (60 + cost)).
"""
import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.gpu_step import TASK, kit_trainer  # noqa: E402
from yolov9_ddp import checkpoint, cli, comm, position  # noqa: E402


def synchronize():
    if torch.cuda.is_available():  # a dry run on CPUs has nothing to wait for
        torch.cuda.synchronize()


def timed(fn, repeats=5) -> float:
    """Median seconds of fn(), the GPU idle before each call."""
    times = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class Aside(checkpoint.TensorsAside):
    """TensorsAside with the copy to the host replaced: `copy` None keeps each tensor where it is (the pickling
    alone), else copy(tensor)."""

    def __init__(self, file, copy):
        super().__init__(file)
        self.copy = copy

    def reducer_override(self, obj):
        reduced = super().reducer_override(obj)
        if reduced is not NotImplemented and self.copy is not None:
            self.tensors[-1] = self.copy(obj)
        return reduced


def save_by_name(obj, f):
    """In save_atomic's place of torch.save(obj, f): torch.save given the file's name, so torch's own file writer
    writes it (tried on 2026-12-02: slower in the background, as it holds the GIL)."""
    torch.save(obj, f.name)


def pickled_aside(obj, copy=None):
    pickler = Aside(io.BytesIO(), copy)
    pickler.dump(obj)
    return pickler.tensors


def parts(trainer, where) -> dict:
    state = trainer.checkpoint_of(where)
    one_each = lambda t: t.detach().to('cpu', copy=True, non_blocking=True)  # noqa: E731
    host = trainer.queue_host_checkpoint(where)()
    sample = next(t for t in checkpoint.QueuedHostCopy(state).copies if t.numel())
    with tempfile.TemporaryDirectory() as folder:
        save_s = timed(lambda: torch.save(host, Path(folder) / 'last.pt'), 3)
        size = (Path(folder) / 'last.pt').stat().st_size
    return {'host_checkpoint_s': timed(lambda: trainer.queue_host_checkpoint(where)()),
            'pickle_only_s': timed(lambda: pickled_aside(state)),
            'pickle_and_blocking_copies_s': timed(lambda: pickled_aside(state, lambda t: t.detach().to('cpu'))),
            'pickle_and_queued_copies_s': timed(lambda: pickled_aside(state, one_each)),
            'pickle_and_grouped_copies_s': timed(lambda: checkpoint.QueuedHostCopy(state)),
            'queued_copy_lands_pinned': sample.is_pinned(),
            'tensors': len(pickled_aside(state)), 'torch_save_s': save_s, 'file_mb': round(size / 2 ** 20, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('--pairs', type=int, default=3)
    p.add_argument('--steps', type=int, default=60)
    p.add_argument('--every', type=int, default=10)
    args, train_args = p.parse_known_args()
    opt = cli.parse_args(train_args, ROOT, TASK)
    device = comm.select_device(opt.device)
    with comm.process_group(device):
        trainer, images, targets = kit_trainer(opt, device)
        step = lambda i: trainer.train_step(trainer.nb + i, 1, images, targets)  # noqa: E731
        for i in range(20):  # warm-up: cudnn's autotuning, the optimizer's momentum buffers
            step(i)
        where = position.Position(1, 5, trainer.nb + 19, int(trainer.accumulate), 0, len(trainer.dataset),
                                  trainer.batch_size, None)
        result = parts(trainer, where)
        folder = Path(tempfile.mkdtemp())
        writer = checkpoint.CheckpointWriter(print)

        def run(with_checkpoints: bool, save=torch.save) -> tuple:
            checkpoint.torch.save = save
            synchronize()
            started, taken = time.perf_counter(), 0
            for i in range(args.steps):
                step(i)
                if with_checkpoints and (i + 1) % args.every == 0:
                    taken += writer.submit(lambda: trainer.queue_host_checkpoint(where), folder / 'last.pt',
                                           f'step {i}')
            synchronize()
            seconds = time.perf_counter() - started
            writer.wait()
            checkpoint.torch.save = torch.save
            return seconds, taken

        pairs = []
        for _ in range(args.pairs):  # without, with, with the file written by torch.save given its name
            plain, _ = run(False)
            checkpointed, taken = run(True)
            by_name, taken_by_name = run(True, save_by_name)
            pairs.append({'plain_s': round(plain, 3), 'checkpointed_s': round(checkpointed, 3), 'checkpoints': taken,
                          'cost_per_checkpoint_s': round((checkpointed - plain) / max(taken, 1), 3),
                          'by_name_s': round(by_name, 3),
                          'cost_per_checkpoint_by_name_s': round((by_name - plain) / max(taken_by_name, 1), 3)})
        cost = statistics.median(p['cost_per_checkpoint_s'] for p in pairs)
        result.update(pairs=pairs, steps=args.steps, every=args.every,
                      step_s=round(statistics.median(p['plain_s'] for p in pairs) / args.steps, 4),
                      median_cost_per_checkpoint_s=cost,
                      median_cost_per_checkpoint_by_name_s=statistics.median(
                          p['cost_per_checkpoint_by_name_s'] for p in pairs),
                      one_a_minute_ratio=round(60 / (60 + cost), 4),
                      gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))


if __name__ == '__main__':
    main()
