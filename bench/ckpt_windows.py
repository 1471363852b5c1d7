#!/usr/bin/env python3
"""A periodic checkpoint every W seconds against none, inside one training run of the kit: alternating windows of
one long epoch (checkpoint_minutes_1_vs_none_1gpu with W = 60).

    python bench/ckpt_windows.py OUT.json [--window-s W] [--pairs P] [--stamp-every K] ARGS
                                                                              (cwd: the kit tree, one process)

ARGS are ddp_train_dual.py's; the run trains with --checkpoint-minutes 2W/60 added, on a training set longer than
the run (an epoch's end saves last.pt and restarts the checkpoints' clock, so the run fails in one line if its epoch
ends first). Around each periodic checkpoint, taken at c, the window [c - W/2, c + W/2) holds that one only, and the
W/2 seconds on either side of it, [c - W, c - W/2) and [c + W/2, c + W), hold none: pair k is (the window without,
the window with) of the k-th checkpoint. The window without lies half before the checkpoint and half after it, so
that a pace that drifts through the run cancels out of the pair instead of counting as the checkpoint's cost (a
window without taken after the window with only came out the faster in every pair of an H200 run). A window's img/s
is its batches over the time from the first to the last of its stamps (the window without: both halves' batches over
both halves' times), taken every K steps after waiting for the GPU. The run stops after the P-th pair, about
(2P + 1) W seconds after the Trainer starts. Each pair also says where its checkpoint's cost fell: its seconds on the
training thread and in the writer's (each also as the thread's CPU seconds), until its file was in place, the img/s
between stamps from 5 s before it to 20 s after, the training seconds it lost (lost_s: the intervals ending in the
LOST_WITHIN_S after it, against the same batches at the pace of the window without's half after it), and the seconds
of garbage collection in each window. A checkpoint of the pairs that was not written (skipped, failed) ends the call
in one line: its pair would measure nothing.

Why one run: two runs per pair would each need epochs of minutes to hold a checkpoint a minute, and 3 pairs of
them do not fit one 10-minute device call; windows of one run share the process, the data stream and the GPU's
warmth with their neighbours.
"""
import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.gpu_step import TASK  # noqa: E402
from yolov9_ddp import cli, comm  # noqa: E402
from yolov9_ddp.parts import Part  # noqa: E402

LOST_WITHIN_S = 5.0  # a checkpoint's cost falls in the seconds after it (a write takes 1-1.5 s on an H200); each
# interval counted beyond adds its own noise


class Enough(Exception):
    """The run has trained the windows it was asked for."""


class TooShort(Exception):
    """The epoch ended before the windows did."""


class NotWritten(Exception):
    """A checkpoint of the windows was skipped or failed: its pair would time a checkpoint that did not happen."""


class Windows:
    """Stamps (seconds, batches trained) of one run at the GPU's pace, and when its periodic checkpoints began."""

    def __init__(self, window_s: float, pairs: int, every: int, cuda: bool, clock=time.monotonic):
        self.window_s, self.pairs, self.every, self.cuda, self.clock = window_s, pairs, every, cuda, clock
        self.stamps, self.checkpoints, self.epoch = [], [], None
        self.parts = []  # per checkpoint: its seconds on the training thread and in the writer's thread
        self.collections = []  # (when, seconds) of each garbage collection: it holds the GIL, every thread waits

    def stamp(self, epoch: int, i: int):
        """After batch i of epoch: a stamp every `every` batches; Enough once the last window has passed."""
        if self.epoch is None:
            self.epoch = epoch
        if epoch != self.epoch:
            raise TooShort(f'the epoch ended after {len(self.stamps) * self.every} batches, before the windows did: '
                           'give a larger training set')
        if i % self.every:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.stamps.append((self.clock(), i + 1))
        if len(self.checkpoints) >= self.pairs and self.stamps[-1][0] >= self.checkpoints[self.pairs - 1] + \
                self.window_s:
            raise Enough

    def rate(self, batch: int, *spans: tuple) -> dict:
        """img/s over spans [(start, end), ...]: in each, from the first to the last stamp in [start, end)."""
        seconds = batches = 0
        for start, end in spans:
            inside = [(t, n) for t, n in self.stamps if start <= t < end]
            if len(inside) < 2:
                raise TooShort(f'{end - start:g} s of a window held {len(inside)} stamp(s), one every {self.every} '
                               'steps: give longer windows (or a smaller --stamp-every)')
            (t0, n0), (t1, n1) = inside[0], inside[-1]
            seconds, batches = seconds + t1 - t0, batches + n1 - n0
        return {'img_per_s': round(batches * batch / seconds, 2), 'seconds': round(seconds, 2), 'batches': batches}

    def timeline(self, c: float, batch: int, before=5.0, after=20.0) -> list:
        """[seconds from c, img/s] of each interval between stamps that ends in [c - before, c + after): where the
        checkpoint's cost falls (its copy on the training thread, then its write beside training)."""
        intervals = zip(self.stamps, self.stamps[1:])
        return [[round(t1 - c, 2), round((n1 - n0) * batch / (t1 - t0), 1)] for (t0, n0), (t1, n1) in intervals
                if c - before <= t1 < c + after]

    def lost_s(self, c: float) -> float:
        """Training seconds the checkpoint taken at c cost: the intervals between stamps that end in
        [c, c + LOST_WITHIN_S), against the same batches at the median pace of the seconds after its window, which
        hold none."""
        half, intervals = self.window_s / 2, list(zip(self.stamps, self.stamps[1:]))
        pace = statistics.median((t1 - t0) / (n1 - n0) for (t0, n0), (t1, n1) in intervals
                                 if c + half <= t0 and t1 < c + 2 * half)
        return round(sum(t1 - t0 - pace * (n1 - n0) for (t0, n0), (t1, n1) in intervals
                         if c <= t1 < c + LOST_WITHIN_S), 3)

    def collected_s(self, *spans: tuple) -> float:
        """Seconds of garbage collection that began in spans [(start, end), ...]."""
        return round(sum(seconds for t, seconds in self.collections for start, end in spans if start <= t < end), 3)

    def pairs_of(self, batch: int) -> list:
        half, taken = self.window_s / 2, self.checkpoints[:self.pairs]
        unwritten = [k + 1 for k, part in enumerate(self.parts[:self.pairs]) if 'written_s' not in part]
        if unwritten:
            raise NotWritten(f'checkpoint {", ".join(map(str, unwritten))} of the windows was not written (the run\'s '
                             'log says why): its pair would time a checkpoint that did not happen')
        started = self.stamps[0][0]
        return [{'checkpoint_at_s': round(c - started, 1),
                 'without': self.rate(batch, (c - 2 * half, c - half), (c + half, c + 2 * half)),
                 'with': self.rate(batch, (c - half, c + half)),
                 'checkpoint': {**part, 'lost_s': self.lost_s(c), 'timeline': self.timeline(c, batch),
                                'gc_s_with': self.collected_s((c - half, c + half)),
                                'gc_s_without': self.collected_s((c - 2 * half, c - half), (c + half, c + 2 * half))}}
                for c, part in zip(taken, self.parts)]


class Stamps(Part):
    """A stamp after every step (Windows.stamp), a part of the run's loop."""

    def __init__(self, windows: Windows):
        self.windows = windows

    def after_step(self, trainer, epoch: int, step: int):
        self.windows.stamp(epoch, step - 1)


def instrument(checkpoints, windows: Windows):
    """Note when each periodic checkpoint starts and how long its parts take (the run's Checkpoints: its save() on
    the training thread, its write() in the writer's thread until the file is in place), and time the garbage
    collections."""
    save, write, timing = checkpoints.save, checkpoints.write, []

    def noted_save(make, path, name, then=(), skip_if_busy=False):
        if not skip_if_busy:  # not a periodic checkpoint: not the windows'
            return save(make, path, name, then, skip_if_busy)
        part = {}
        started, cpu = windows.clock(), time.thread_time()
        windows.checkpoints.append(started)
        windows.parts.append(part)
        timing.append(part)  # before the writer's thread starts, which fills it in
        saved = save(make, path, name, then, skip_if_busy)
        if not saved:  # skipped: no write to time (pairs_of says so)
            timing.remove(part)
        part.update(training_thread_s=round(windows.clock() - started, 3),
                    training_thread_cpu_s=round(time.thread_time() - cpu, 3))
        return saved

    def timed_write(copy, path, name, then):
        if not timing:
            return write(copy, path, name, then)
        part, started, cpu = timing.pop(), windows.clock(), time.thread_time()

        def written():  # the file is in place
            part['written_s'] = round(windows.clock() - started, 3)
        write(copy, path, name, (*then, written))
        part.update(write_s=round(windows.clock() - started, 3), write_cpu_s=round(time.thread_time() - cpu, 3))

    collection = {}

    def timed_collection(phase, info):
        if phase == 'start':
            collection['started'] = windows.clock()
        else:
            windows.collections.append((collection['started'], windows.clock() - collection['started']))
    checkpoints.save, checkpoints.write = noted_save, timed_write
    gc.callbacks.append(timed_collection)


def windows_of_run(trainer, windows: Windows) -> list:
    """Train until the windows have passed, then their pairs (TooShort or NotWritten where they measure nothing)."""
    try:
        trainer.fit()
        raise TooShort('the run ended before the windows did: give more epochs or a larger training set')
    except Enough:
        pass
    finally:
        trainer.close()  # a checkpoint write under way ends first
    return windows.pairs_of(trainer.batch_size)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('--window-s', type=float, default=60.0, metavar='W')
    p.add_argument('--pairs', type=int, default=3)
    p.add_argument('--stamp-every', type=int, default=10, metavar='K',
                   help='steps between stamps, each a wait for the GPU (the kit waits for it as often, to show losses)')
    args, train_args = p.parse_known_args()
    opt = cli.parse_args([*train_args, '--checkpoint-minutes', f'{2 * args.window_s / 60:g}'], ROOT, TASK)
    if comm.launched_world_size() > 1:
        raise SystemExit('ckpt_windows.py: one process (periodic checkpoints are rank 0\'s; the windows are its)')
    cli.check_options(opt, 1, TASK)
    device = comm.select_device(opt.device)
    from yolov9_ddp.build import plan_start, prepare
    with comm.process_group(device):
        windows = Windows(args.window_s, args.pairs, args.stamp_every, device.type == 'cuda')
        trainer = prepare(TASK, opt, device, plan_start(opt), extra_parts=[Stamps(windows)])
        instrument(trainer.checkpoints, windows)
        try:
            pairs = windows_of_run(trainer, windows)
        except (TooShort, NotWritten) as e:
            raise SystemExit(f'ckpt_windows.py: {e}') from None
        args.out.write_text(json.dumps({
            'window_s': args.window_s, 'checkpoint_minutes': opt.checkpoint_minutes, 'levers': opt.levers,
            'batch': trainer.batch_size,
            'checkpoints_at_s': [round(c - windows.stamps[0][0], 1) for c in windows.checkpoints],
            'lost_s': [pair['checkpoint']['lost_s'] for pair in pairs], 'pairs': pairs}))


if __name__ == '__main__':
    main()
