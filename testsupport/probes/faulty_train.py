"""A kit entry point with faults injected: run by torchrun (or python) INSTEAD of ddp_train_dual.py (or the entry point
of FAULT_TASK, a task of yolov9_ddp.tasks), with the patched tree as the current folder.

    FAULT='[{"action": "kill", "rank": 1, "epoch": 1, "step": 3}]' FAULT_DIR=/tmp/record \\
        torchrun ... testsupport/probes/faulty_train.py TRAIN_ARGS...

FAULT holds testsupport.injected.Fault values (their actions and places are listed there). They reach the run as one
more part of its loop (Faults, yolov9_ddp/parts/), which acts at the loop's points and wraps the collaborators the
trainer exposes there (its loss, its datasets' loaders, its checkpoints' file writer); three places outside the loop
(resume_options, opt_yaml, report) wrap the function named, which must exist.

FAULT_DIR (optional) receives one JSON file per event (KIND-rankR-attemptA-pidP-N.json, each with kind, rank,
attempt, pid and time), so a test can tell what happened on which rank:
  start   training starts, at its epoch and step, from its weights
  fired   a fault fired (written before it takes effect), with the epoch in progress
  exit    the process returned from main() by itself: its exit status, whether destroy_process_group ran,
          the epoch in progress, the faults of this rank and attempt that never fired
"""
import contextlib
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the patched tree, as for `python ddp_train_dual.py` there
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the kit's testsupport (its yolov9_ddp: the tree's)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from testsupport.injected import from_env  # noqa: E402
from yolov9_ddp import build, entry, failures, files  # noqa: E402
from yolov9_ddp.parts import Part  # noqa: E402
from yolov9_ddp.tasks import TASKS  # noqa: E402

TASK = TASKS[os.environ.get('FAULT_TASK', 'detect-dual')]
INJECTED = 'injected fault'  # in the message of every exception a `raise` fault raises
RANK = int(os.environ.get('RANK', 0))
ATTEMPT = int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0))
RECORD = Path(os.environ['FAULT_DIR']) if os.environ.get('FAULT_DIR') else None
FAULTS = [f for f in from_env(os.environ.get('FAULT')) if f.rank == RANK and f.attempt == ATTEMPT]
STATE = {'epoch': None, 'step': None, 'validating': None, 'final': False, 'events': 0, 'destroyed': False,
         'trainer': None, 'getitem_calls': 0}


def record(kind: str, **fields):
    if RECORD is None:
        return
    RECORD.mkdir(parents=True, exist_ok=True)
    name = f'{kind}-rank{RANK}-attempt{ATTEMPT}-pid{os.getpid()}-{STATE["events"]}'
    STATE['events'] += 1
    files.atomic_write(RECORD / f'{name}.json', lambda f: f.write(json.dumps(
        {'kind': kind, 'rank': RANK, 'attempt': ATTEMPT, 'pid': os.getpid(), 'time': time.time(), **fields}).encode()))


def due(where: str, epoch=None, step=0) -> list:
    """The faults of this place that fire now (removed from the list: each fires once)."""
    hits = [f for f in FAULTS if f.where == where and f.epoch in (None, epoch)
            and (where not in ('step', 'loss', 'getitem') or f.step == step)]
    for f in hits:
        FAULTS.remove(f)
    return hits


def fire(faults, rank_pid=None, **detail):
    """Each fault's action, here; rank_pid: the rank's process, where this one is its checkpoint writer."""
    for fault in faults:
        print(f'faulty_train.py [rank {RANK}, attempt {ATTEMPT}]: {fault.action} at {fault.where} '
              f'epoch {STATE["epoch"]} {detail or ""}', file=sys.stderr, flush=True)
        record('fired', fault=fault.__dict__, epoch=STATE['epoch'], **detail)
        if fault.action == 'kill':
            os.kill(rank_pid or os.getpid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)  # the writer too, before it writes more
        elif fault.action == 'killworker':
            os.kill(detail.get('worker') or loader_worker_pid(fault.loader), signal.SIGKILL)
        elif fault.action == 'raise':
            message = f'{INJECTED} on rank {RANK} at {fault.where}'
            raise torch.cuda.OutOfMemoryError(f'CUDA out of memory ({message})') if fault.error == 'oom' \
                else ValueError(message)
        elif fault.action == 'stall':
            while True:  # a signal handler that returns does not end it; SIGKILL does
                time.sleep(3600)
        elif fault.action == 'mark':
            if RECORD is not None:
                (RECORD / f'mark-{fault.name}').touch()
            time.sleep(fault.sleep)
        elif fault.action == 'slow':
            time.sleep(fault.sleep)
        elif fault.action == 'hold':
            deadline = time.monotonic() + fault.sleep
            stop = next(p for p in STATE['trainer'].parts if hasattr(p, 'request')).request
            while stop.signum is None and time.monotonic() < deadline:
                time.sleep(0.1)


def loader_worker_pid(loader: str) -> int:
    """The pid of a live worker of this rank's training or validation loader (persistent: started at its first
    epoch)."""
    workers = getattr(getattr(STATE['trainer'], f'{loader}_loader'), '_iterator', None)
    alive = [w.pid for w in getattr(workers, '_workers', []) if w.is_alive()]
    if not alive:
        raise SystemExit(f'faulty_train.py: no live {loader} loader worker to kill (needs --workers > 0 and a loader '
                         f'that has started)')
    return alive[0]


class Faults(Part):
    """The faults of this rank, at the loop's points; runs before the run's own parts at each point."""

    def before_train(self, trainer):
        STATE['trainer'] = trainer
        record('start', start_epoch=trainer.state.epoch, start_step=trainer.state.step,
               weights=str(trainer.opt.weights))
        trainer.compute_loss = LossFaults(trainer.compute_loss)
        samples = trainer.train_loader.dataset  # yolov9_ddp.stream.SeededSamples: its dataset is upstream's
        samples.dataset = DatasetFaults(samples.dataset)
        trainer.val_loader = LoaderFaults(trainer.val_loader)
        if trainer.checkpoints is not None:
            trainer.checkpoints.save_file = SaveFaults()

    def before_step(self, trainer, epoch: int, step: int):
        STATE['epoch'], STATE['step'], STATE['validating'] = epoch, step, None
        faults = settled(trainer, due('step', epoch, step))
        if any(f.wipe for f in faults):
            for path in trainer.weights_dir.glob('*.pt'):
                path.unlink()
        fire(faults, step=step)

    def after_step(self, trainer, epoch: int, step: int):
        STATE['step'] = None

    def after_epoch(self, trainer, epoch: int):
        fire(settled(trainer, due('sync_ema', epoch)))
        STATE['validating'] = epoch

    def after_train(self, trainer):
        STATE['validating'], STATE['final'] = None, True


def settled(trainer, faults: list) -> list:
    """The faults, once the checkpoints written before them are on disk: a scenario measures what a fault costs, not
    its race with the write of the epoch before (a kill mid-write is a fault of its own, at 'save')."""
    if faults and trainer.checkpoints is not None:
        trainer.checkpoints.wait()
    return faults


class LossFaults:
    def __init__(self, loss):
        self.loss = loss

    def __call__(self, *args, **kwargs):
        if STATE['step'] is not None:
            fire(due('loss', STATE['epoch'], STATE['step']), step=STATE['step'])
        return self.loss(*args, **kwargs)


class DatasetFaults:
    """Upstream's training dataset, counting the calls of __getitem__ in each process (a loader worker: its own)."""

    def __init__(self, dataset):
        self.__dict__['dataset'] = dataset

    def __getattr__(self, name):
        return getattr(self.dataset, name)

    def __setattr__(self, name, value):
        setattr(self.dataset, name, value)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        calls, STATE['getitem_calls'] = STATE['getitem_calls'], STATE['getitem_calls'] + 1
        fire(due('getitem', None, calls), index=index)
        return self.dataset[index]


class LoaderFaults:
    """The validation loader, firing once its first batch has gone through the model (the next is asked for)."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i == 1 and STATE['validating'] is not None:
                fire(due('val', STATE['validating']), batch='first')
            elif i == 1 and STATE['final']:
                fire(due('final_val'), batch='first')
            yield batch


class SaveFaults:
    """The checkpoints' file writer (checkpoints.save_file), in the writer process or thread: faults of last.pt's
    writes (the checkpoint's 'epoch', upstream's, is the last complete one) and of the final strip, which is the last
    epoch's write where that goes out stripped (parts/epoch_end.py), and then its faults too. The writer process,
    forked from the rank before training, has its own copy of the rank's faults; pickled there with each checkpoint,
    this takes along what only the rank knows: its pid and its loader workers."""

    def __init__(self):
        self.rank_pid, self.workers, self.epoch = os.getpid(), {}, None

    def __getstate__(self):
        for fault in FAULTS:
            if fault.action == 'killworker' and fault.where in ('save', 'rename', 'strip'):
                self.workers[fault.loader] = loader_worker_pid(fault.loader)
        return {**self.__dict__, 'epoch': STATE['epoch']}

    def __call__(self, ckpt: dict, path: Path, keep_previous=False):
        stripping, half, between = ckpt['epoch'] == -1, [], []
        if path.name.startswith('last'):
            saving = not stripping or keep_previous  # a strip keeps no previous file; the last epoch's write does
            epoch = ckpt['epoch'] if not stripping else self.epoch if self.epoch is not None else STATE['epoch']
            half = (due('strip') if stripping else []) + (due('save', epoch) if saving else [])
            between = due('rename', epoch) if saving else []
        with self.killed_between_renames(between):
            files.atomic_write(path, lambda f: self.half_then_fire(ckpt, f, half), keep_previous)

    def fire(self, faults, **detail):
        if self.epoch is not None:  # the rank's epoch in progress, in its writer process
            STATE['epoch'] = self.epoch
        worker = {'worker': self.workers.get(faults[0].loader)} if faults and self.workers else {}
        fire(faults, rank_pid=self.rank_pid, **detail, **worker)

    def half_then_fire(self, ckpt, f, faults):
        """torch.save's bytes, half of them on disk when the faults fire, the rest if this process is still there."""
        if not faults:
            torch.save(ckpt, f)
            return
        buffer = io.BytesIO()
        torch.save(ckpt, buffer)
        data = buffer.getvalue()
        f.write(data[:len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        self.fire(faults, file=f.name, written=len(data) // 2, size=len(data))
        f.write(data[len(data) // 2:])  # a fault this process survives (a killed loader worker)

    @contextlib.contextmanager
    def killed_between_renames(self, faults):
        """Fire right after atomic_write has moved last.pt aside to last.previous.pt, before the new file takes its
        place (the one moment at which last.pt does not exist)."""
        if not faults:
            yield
            return
        real_replace = os.replace

        def replace_then_fire(src, dst, *args, **kwargs):
            real_replace(src, dst, *args, **kwargs)
            if Path(dst) == files.previous_path(Path(src)):
                self.fire(faults, moved=str(src), to=str(dst))

        os.replace = replace_then_fire
        try:
            yield
        finally:
            os.replace = real_replace


def before(owner, name: str, place: str):
    """Fire the faults of place whenever owner.name (which must exist) is called, before it runs."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        fire(due(place))
        return original(*args, **kwargs)
    setattr(owner, name, wrapped)


def destroy_process_group_recorded():
    original = dist.destroy_process_group

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        STATE['destroyed'] = True
        return result
    dist.destroy_process_group = wrapped


def main() -> int:
    before(entry, 'report', 'report')
    before(build, 'restore_resumed_options', 'resume_options')
    before(build, 'save_options', 'opt_yaml')
    destroy_process_group_recorded()
    status = entry.main(TASK.name, sys.argv[1:], root=Path.cwd(), parts=[Faults()])
    record('exit', status=status, destroyed=STATE['destroyed'], epoch=STATE['epoch'],
           unfired=[f.__dict__ for f in FAULTS])
    return status


if __name__ == '__main__':
    failures.end_process(main())  # as the entry points end
