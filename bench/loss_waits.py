#!/usr/bin/env python3
"""Patches 0016 and 0017 and the levers host_targets and dense_box_loss on a GPU: how often the kit's detection loss
waits for the GPU, given the batch's targets on the GPU (as upstream's scripts give them) or on the host
(host_targets=1), and with its box losses over every anchor too (dense_box_loss=1); whether the first two give the
same numbers, bit for bit, and how far the third's are from them.

    python bench/loss_waits.py OUT.json ARGS       (cwd: the kit tree; ARGS are ddp_train_dual.py's, --device 0)

One forward pass of the kit's Trainer on a fixed batch (bench/gpu_step.py), under its autocast; its outputs, detached,
are the inputs of every loss call below, so that only the targets' device differs. Each way: the loss, its items and
its gradients with respect to those outputs, twice (a difference between the two calls of one way is the GPU's own
nondeterminism, which would make a comparison of the ways meaningless), and the synchronising calls of one loss call
(torch.cuda.set_sync_debug_mode: each is a wait of the host for the GPU). set_sync_debug_mode knows only the waits
torch asks for; a copy the driver must stage (pageable host memory) may wait on its own. So each way also times one
loss call on the host behind a second of queued GPU work (torch.cuda._sleep): a call that waits anywhere takes that
second. Writes the counts, the times and the comparisons.
"""
import hashlib
import json
import sys
import time
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.gpu_step import TASK, fixed_batch  # noqa: E402
from yolov9_ddp import cli, comm  # noqa: E402


def leaves(outputs):
    """The model's outputs (nested lists of tensors) as detached leaves that collect their gradients."""
    if isinstance(outputs, torch.Tensor):
        return outputs.detach().requires_grad_()
    return type(outputs)(leaves(x) for x in outputs)


def flat(outputs) -> list:
    return [outputs] if isinstance(outputs, torch.Tensor) else [t for x in outputs for t in flat(x)]


def one_loss(trainer, compute_loss, outputs, targets) -> tuple:
    """(the loss, its items and its gradients as one hash; the synchronising calls it made, counted by the line of
    Python that made them)."""
    inputs = leaves(outputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        with torch.amp.autocast('cuda', enabled=trainer.amp):
            loss, items = compute_loss(inputs, targets)
        torch.cuda.set_sync_debug_mode('default')
    loss.backward()
    grads = hashlib.sha256(b''.join(t.grad.float().cpu().numpy().tobytes() for t in flat(inputs) if t.grad is not None))
    waits = Counter(f'{Path(w.filename).name}:{w.lineno}' for w in caught if 'synchronizing' in str(w.message))
    return (loss.item(), items.tolist(), grads.hexdigest()), waits


def gpu_sleep_cycles(seconds: float) -> int:
    """The cycles of torch.cuda._sleep that keep the GPU busy for about `seconds`, from a timed tenth of them."""
    cycles = 10**8
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds / (start.elapsed_time(end) / 1000))


def timed_behind_queued_work(compute_loss, outputs, targets, amp: bool, sleep_cycles: int) -> dict:
    """The host's time for one loss call queued behind about a second of GPU work, and that work's own time (CUDA
    events): the first well under the second if nothing waits, and unless the call issues more kernels than the
    driver queues (about a thousand)."""
    inputs = leaves(outputs)
    torch.cuda.synchronize()
    queued, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    queued.record()
    torch.cuda._sleep(sleep_cycles)
    done.record()
    start = time.perf_counter()
    with torch.amp.autocast('cuda', enabled=amp):
        compute_loss(inputs, targets)
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return {'host_s': round(seconds, 4), 'gpu_queue_s': round(queued.elapsed_time(done) / 1000, 4)}


def main():
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    opt = cli.parse_args(argv, ROOT, TASK)
    device = comm.select_device(opt.device)
    if device.type != 'cuda':
        raise SystemExit('loss_waits.py: counts the waits for a GPU; give --device 0')
    from yolov9_ddp.trainer import plan_start, prepare_trainer
    with comm.process_group(device):
        trainer = prepare_trainer(TASK, opt, device, plan_start(opt))
        images, targets = fixed_batch(trainer.dataset, 0, trainer.batch_size, opt.seed)
        images = images.to(device).float() / 255
        trainer.model.train()
        with torch.no_grad(), torch.amp.autocast('cuda', enabled=trainer.amp):
            outputs = trainer.raw_model(images)
        dense = TASK.loss(trainer.raw_model, trainer.opt, replace(trainer.levers, dense_box_loss=True))  # as a run's
        ways = {'gpu_targets': (trainer.compute_loss, lambda: targets.to(device)),
                'host_targets': (trainer.compute_loss, lambda: targets.pin_memory()),
                'dense_box_loss': (dense, lambda: targets.pin_memory())}
        result, sleep_cycles = {}, gpu_sleep_cycles(1.0)
        for way, (compute_loss, made) in ways.items():
            (first, waits), (again, _) = (one_loss(trainer, compute_loss, outputs, made()) for _ in range(2))
            behind = timed_behind_queued_work(compute_loss, outputs, made(), trainer.amp, sleep_cycles)
            result[way] = {'waits_a_loss_call': sum(waits.values()), 'waits_where': dict(waits),
                           'a_loss_call_behind_queued_gpu_work': behind,
                           'numbers': first, 'repeatable': first == again}
        result['same_numbers'] = result['gpu_targets']['numbers'] == result['host_targets']['numbers']
        (exact, exact_items, _), (dense_value, dense_items, _) = (result[way]['numbers']
                                                                  for way in ('host_targets', 'dense_box_loss'))
        result['dense_box_loss_relative_difference'] = max(
            abs(a - b) / max(abs(a), 1e-12) for a, b in zip([exact, *exact_items], [dense_value, *dense_items]))
        result['targets'] = int(targets.shape[0])
        out.write_text(json.dumps(result, indent=1) + '\n')
        print(json.dumps({way: {k: v for k, v in r.items() if k != 'numbers'} if isinstance(r, dict) else r
                          for way, r in result.items()}))


if __name__ == '__main__':
    main()
