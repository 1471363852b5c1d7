"""A kit entry point with faults injected from outside: run by torchrun (or python) INSTEAD of ddp_train_dual.py
(or the entry point of FAULT_TASK, a task of yolov9_ddp.tasks), with the patched tree as the current folder. It
wraps functions of the real training code, then calls yolov9_ddp.entry.main(); the production code has no hooks
for this.

    FAULT='kill:rank=1:where=step:epoch=1:step=3:attempt=0;mark:where=step:epoch=1:step=1:sleep=2' \\
    FAULT_DIR=/tmp/record torchrun ... testsupport/probes/faulty_train.py TRAIN_ARGS...

FAULT is a ';'-separated list of faults ACTION:key=value:...; each fires at most once per process.
  ACTION   kill   SIGKILL this process (no Python clean-up, as the OOM killer or a lost node)
           killworker  SIGKILL one loader worker of this rank (`loader`: train or val), as the OOM killer often
                  picks one; the trainer learns of it from its SIGCHLD handler wherever it is at that moment
           raise  raise an exception here on this rank only (`error`: value, a ValueError as a bug would raise;
                  oom, torch's CUDA out-of-memory error type)
           stall  sleep for good, before the collective of `where` (a hung rank); only signals end it
           mark   write FAULT_DIR/mark-NAME (NAME: the `name` key, default 'mark') and go on, after `sleep`
                  seconds: tells a test that training has reached this point (e.g. to send a signal)
           slow   sleep `sleep` seconds there, then go on (a slow rank, a slow shared filesystem)
           hold   wait there until this rank is asked to stop (a signal), for `sleep` seconds at most: keeps a start
                  training until a signal whose moment Slurm chooses (a time-limit warning); where=step only
  where    step      before training step `step` of `epoch` (default)
           loss      in the loss of training step `step` of `epoch`, after the forward pass
           getitem   in the training dataset's __getitem__, at its `step`-th call in the process that runs it
                     (a loader worker when --workers > 0)
           val       in the validation after `epoch`, once its first batch went through the model
           final_val in the validation of best.pt at the end of training, once its first batch went through
           save      writing last.pt for `epoch` (rank 0): after half of the temporary file is written and flushed
           rename    writing last.pt for `epoch` (rank 0): once the old last.pt is moved to last.previous.pt, before
                     the new one takes its place
           strip     the end of training (rank 0): after half of the stripped last.pt is written over the old one
           sync_ema  before the per-epoch all_reduce of the EMA (yolov9_ddp.ema.synchronize_ema)
           resume_options   before a resumed run reads the run's opt.yaml (restore_resumed_options)
           opt_yaml  rank 0 (re)writing the run's opt.yaml: after the file is truncated, before its text is written
           report    a failed rank about to print (or leave to another rank) its one error line (entry.report)
  rank     global rank (default 0); attempt: torchrun's TORCHELASTIC_RESTART_COUNT (default 0);
  epoch    (default: any); step (default 0)
  wipe     1: first delete the run's weights/*.pt (checkpoints lost with a node's disk); where=step only

FAULT_DIR (optional) receives one JSON file per event (KIND-rankR-attemptA-pidP-N.json, each with kind, rank,
attempt, pid and time), so a test can tell what happened on which rank:
  start   training starts (Trainer.fit) at start_epoch and start_step, from weights
  fired   a fault fired (written before it takes effect), with the epoch in progress
  exit    the process returned from main() by itself: its exit status, whether destroy_process_group ran,
          the epoch in progress
"""
import contextlib
import io
import json
import os
import signal
import sys
import time
from importlib import import_module
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the patched tree, as for `python ddp_train_dual.py` there

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from yolov9_ddp import checkpoint, entry, failures, trainer  # noqa: E402
from yolov9_ddp.tasks import TASKS  # noqa: E402

TASK = TASKS[os.environ.get('FAULT_TASK', 'detect-dual')]

ACTIONS = ('kill', 'killworker', 'raise', 'stall', 'mark', 'slow', 'hold')
PLACES = ('step', 'loss', 'getitem', 'val', 'final_val', 'save', 'rename', 'strip', 'sync_ema', 'resume_options',
          'opt_yaml', 'report')
INJECTED = 'injected fault'  # in the message of every exception a `raise` fault raises
RANK = int(os.environ.get('RANK', 0))
ATTEMPT = int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0))
RECORD = Path(os.environ['FAULT_DIR']) if os.environ.get('FAULT_DIR') else None
STATE = {'epoch': None, 'validating': None, 'final': False, 'events': 0, 'destroyed': False, 'trainer': None,
         'getitem_calls': 0}


def parse(text: str) -> list:
    faults = []
    for item in filter(None, (part.strip() for part in (text or '').split(';'))):
        action, *pairs = item.split(':')
        fault = {'action': action, 'where': 'step', 'rank': 0, 'attempt': 0, 'epoch': None, 'step': 0,
                 'sleep': 0.0, 'name': 'mark', 'wipe': 0, 'loader': 'train', 'error': 'value'}
        for pair in pairs:
            key, value = pair.split('=', 1)
            if key not in fault:
                raise SystemExit(f'faulty_train.py: unknown key {key!r} in FAULT item {item!r}')
            fault[key] = value if key in ('where', 'name', 'loader', 'error') else float(value) if key == 'sleep' \
                else int(value)
        if action not in ACTIONS or fault['where'] not in PLACES:
            raise SystemExit(f'faulty_train.py: bad FAULT item {item!r} (actions {ACTIONS}, places {PLACES})')
        faults.append(fault)
    return faults


FAULTS = parse(os.environ.get('FAULT', ''))


def record(kind: str, **fields):
    if RECORD is None:
        return
    RECORD.mkdir(parents=True, exist_ok=True)
    name = f'{kind}-rank{RANK}-attempt{ATTEMPT}-pid{os.getpid()}-{STATE["events"]}'
    STATE['events'] += 1
    tmp = RECORD / f'.{name}.tmp'
    tmp.write_text(json.dumps({'kind': kind, 'rank': RANK, 'attempt': ATTEMPT, 'pid': os.getpid(), 'time': time.time(),
                               **fields}))
    os.replace(tmp, RECORD / f'{name}.json')


def due(where: str, epoch=None, step=0) -> list:
    """The faults of this place that fire now (removed from the list: each fires once)."""
    hits = [f for f in FAULTS if f['where'] == where and f['rank'] == RANK and f['attempt'] == ATTEMPT
            and f['epoch'] in (None, epoch) and (where not in ('step', 'loss', 'getitem') or f['step'] == step)]
    for f in hits:
        FAULTS.remove(f)
    return hits


def fire(fault: dict, **detail):
    print(f'faulty_train.py [rank {RANK}, attempt {ATTEMPT}]: {fault["action"]} at {fault["where"]} '
          f'epoch {STATE["epoch"]} {detail or ""}', file=sys.stderr, flush=True)
    record('fired', fault=fault, epoch=STATE['epoch'], **detail)
    if fault['action'] == 'kill':
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault['action'] == 'killworker':
        os.kill(loader_worker_pid(fault['loader']), signal.SIGKILL)
    elif fault['action'] == 'raise':
        message = f'{INJECTED} on rank {RANK} at {fault["where"]}'
        raise torch.cuda.OutOfMemoryError(f'CUDA out of memory ({message})') if fault['error'] == 'oom' \
            else ValueError(message)
    elif fault['action'] == 'stall':
        while True:  # a signal handler that returns does not end it; SIGKILL does
            time.sleep(3600)
    elif fault['action'] == 'mark':
        if RECORD is not None:
            (RECORD / f'mark-{fault["name"]}').touch()
        time.sleep(fault['sleep'])
    elif fault['action'] == 'slow':
        time.sleep(fault['sleep'])
    elif fault['action'] == 'hold':
        deadline = time.monotonic() + fault['sleep']
        while STATE['trainer'].stop.signum is None and time.monotonic() < deadline:
            time.sleep(0.1)


def loader_worker_pid(loader: str) -> int:
    """The pid of a live worker of this rank's training or validation loader (persistent: started at its first
    epoch), detail: the iterator's worker processes."""
    trainer = STATE['trainer']
    workers = getattr(getattr(trainer, f'{loader}_loader'), '_iterator', None)
    alive = [w.pid for w in getattr(workers, '_workers', []) if w.is_alive()]
    if not alive:
        raise SystemExit(f'faulty_train.py: no live {loader} loader worker to kill (needs --workers > 0 and a loader '
                         f'that has started)')
    return alive[0]


def fire_all(faults, **detail):
    for fault in faults:
        fire(fault, **detail)


@contextlib.contextmanager
def half_written(faults):
    """While faults are due: torch.save writes half of its bytes to the file, flushes them to disk, fires, and
    writes the rest if this process is still there."""
    if not faults:
        yield
        return
    real_save = torch.save

    def half_then_fire(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        with contextlib.ExitStack() as stack:
            handle = f if hasattr(f, 'write') else stack.enter_context(open(f, 'wb'))
            handle.write(data[:len(data) // 2])
            handle.flush()
            os.fsync(handle.fileno())
            fire_all(faults, file=str(handle.name), written=len(data) // 2, size=len(data))
            handle.write(data[len(data) // 2:])  # a fault this process survives (a killed loader worker)

    torch.save = half_then_fire
    try:
        yield
    finally:
        torch.save = real_save


@contextlib.contextmanager
def killed_between_renames(faults):
    """While faults are due: fire right after save_atomic has moved last.pt aside to last.previous.pt, before the
    new file takes its place (the one moment at which last.pt does not exist)."""
    if not faults:
        yield
        return
    real_replace = os.replace

    def replace_then_fire(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        if Path(dst) == checkpoint.previous_path(Path(src)):
            fire_all(faults, moved=str(src), to=str(dst))

    os.replace = replace_then_fire
    try:
        yield
    finally:
        os.replace = real_replace


# -- the wrapped functions -------------------------------------------------------------------------------------------

def wrap(owner, name, make):
    original = getattr(owner, name)
    setattr(owner, name, make(original))


def install():
    def report(original):
        def wrapped(*args, **kwargs):
            fire_all(due('report'))
            return original(*args, **kwargs)
        return wrapped

    def train_epoch(original):
        def wrapped(self, epoch, *args):
            STATE['epoch'] = epoch
            return original(self, epoch, *args)
        return wrapped

    def fit(original):
        def wrapped(self):
            STATE['trainer'] = self
            self.compute_loss = compute_loss(self.compute_loss)
            record('start', start_epoch=self.start.epoch, start_step=self.start.step, weights=str(self.opt.weights))
            return original(self)
        return wrapped

    def finish(original):
        def wrapped(self, *args, **kwargs):
            STATE['final'] = True
            return original(self, *args, **kwargs)
        return wrapped

    def train_step(original):
        def wrapped(self, ni, epoch, imgs, targets, **loss_inputs):
            faults = due('step', epoch, ni - self.nb * epoch)
            if any(f['wipe'] for f in faults):
                for path in self.weights_dir.glob('*.pt'):
                    path.unlink()
            fire_all(faults, step=ni - self.nb * epoch)
            STATE['step'] = ni - self.nb * epoch
            try:
                return original(self, ni, epoch, imgs, targets, **loss_inputs)
            finally:
                STATE['step'] = None
        return wrapped

    def compute_loss(original):  # the trainer's loss, called after the forward pass of a step (and in validation)
        def wrapped(*args, **kwargs):
            if STATE.get('step') is not None:
                fire_all(due('loss', STATE['epoch'], STATE['step']), step=STATE['step'])
            return original(*args, **kwargs)
        return wrapped

    def getitem(original):  # runs in the loader workers (forked: each counts its own calls)
        def wrapped(self, index):
            if self.augment:  # the training dataset
                calls, STATE['getitem_calls'] = STATE['getitem_calls'], STATE['getitem_calls'] + 1
                fire_all(due('getitem', None, calls), index=index)
            return original(self, index)
        return wrapped

    def end_epoch(original):
        def wrapped(self, epoch, *args, **kwargs):
            STATE['validating'] = epoch
            try:
                return original(self, epoch, *args, **kwargs)
            finally:
                STATE['validating'] = None
        return wrapped

    def synchronize_ema(original):
        def wrapped(ema, model):
            fire_all(due('sync_ema', STATE['epoch']))
            return original(ema, model)
        return wrapped

    def non_max_suppression(original):  # val_dual calls it once per batch, after the model's forward pass
        def wrapped(*args, **kwargs):
            if STATE['validating'] is not None:
                fire_all(due('val', STATE['validating']), batch='first')
            elif STATE['final']:
                fire_all(due('final_val'), batch='first')
            return original(*args, **kwargs)
        return wrapped

    def save_atomic(original):
        def wrapped(obj, path, *args, **kwargs):
            last = Path(path).name == 'last.pt'
            half = due('save', obj.get('epoch')) if last else []
            between = due('rename', obj.get('epoch')) if last else []
            with half_written(half), killed_between_renames(between):
                return original(obj, path, *args, **kwargs)
        return wrapped

    def strip_optimizer(original):  # upstream's, run on last.pt and best.pt when training has finished
        def wrapped(f='best.pt', s=''):
            with half_written(due('strip') if Path(f).name == 'last.pt' else []):
                return original(f, s)
        return wrapped

    def restore_resumed_options(original):
        def wrapped(*args, **kwargs):
            fire_all(due('resume_options'))
            return original(*args, **kwargs)
        return wrapped

    def yaml_save(original):  # upstream's: open(file, 'w') then yaml.safe_dump
        def wrapped(file='data.yaml', data=None):
            faults = due('opt_yaml') if Path(file).name == 'opt.yaml' else []
            if faults:
                Path(file).write_text('')  # what open(file, 'w') has done before the text arrives
                fire_all(faults)
            return original(file, {} if data is None else data)
        return wrapped

    def destroy_process_group(original):
        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            STATE['destroyed'] = True
            return result
        return wrapped

    wrap(trainer.Trainer, 'fit', fit)
    wrap(trainer.Trainer, 'finish', finish)
    wrap(TASK.dataset_class(), '__getitem__', getitem)
    wrap(trainer.Trainer, 'train_epoch', train_epoch)
    wrap(trainer.Trainer, 'train_step', train_step)
    wrap(trainer.Trainer, 'end_epoch', end_epoch)
    wrap(trainer, 'synchronize_ema', synchronize_ema)
    wrap(import_module(TASK.validator), 'non_max_suppression', non_max_suppression)
    wrap(checkpoint, 'save_atomic', save_atomic)
    wrap(trainer, 'strip_optimizer', strip_optimizer)
    wrap(trainer, 'restore_resumed_options', restore_resumed_options)
    wrap(trainer, 'yaml_save', yaml_save)
    wrap(dist, 'destroy_process_group', destroy_process_group)
    wrap(entry, 'report', report)


def main() -> int:
    install()
    status = entry.main(TASK.name, sys.argv[1:], root=Path.cwd())
    unfired = [f for f in FAULTS if f['rank'] == RANK and f['attempt'] == ATTEMPT]
    record('exit', status=status, destroyed=STATE['destroyed'], epoch=STATE['epoch'], unfired=unfired)
    return status


if __name__ == '__main__':
    failures.end_process(main())  # as the entry points end
