"""Checkpoints: written whole or not at all (files.atomic_write), off the training thread, and read back with a clear
error when they are not usable. Their format is upstream's (its val_dual.py, detect_dual.py and attempt_load() read
the kit's files), plus what an exact resume needs (state.py).

Rank 0's Checkpoints writes every last.pt (an epoch's end, --checkpoint-steps or --checkpoint-minutes, a signal),
keeping the one it replaces as last.previous.pt, and best.pt and epochN.pt as copies of an epoch's last.pt: the
training thread queues a host copy (hostcopy.py) and goes on, and a writer thread hands it to the writer process
(writer.py), one write at a time, as torchtitan's asynchronous checkpoints.
"""
import pickle
import shutil
import threading
import time
import zipfile
from pathlib import Path

import torch

from yolov9_ddp.comm import Unanimous, broadcast_object, is_primary, raise_if_any_failed
from yolov9_ddp.files import atomic_write, previous_path
from yolov9_ddp.hostcopy import QueuedHostCopy, scaler_numbers

FORMAT = 'yolov9-ddp/1'
RESUME_KEYS = ('epoch', 'model', 'ema', 'updates', 'optimizer', 'opt')
COPY_CHUNK = 16 * 2 ** 20  # bytes


class CheckpointError(Exception):
    """A checkpoint file that cannot be used; the message names the file and the reason."""


class FinalCheckpoint(CheckpointError):
    """A run's final checkpoint, stripped of what a resume needs."""


class ModelMismatch(CheckpointError, Unanimous):
    """A resume checkpoint of another model: every rank finds it loading the same weights."""


# -- files ------------------------------------------------------------------------------------------------------------

def save_file(obj, path: Path, keep_previous=False):
    """A checkpoint (or any object torch.save takes) written to path with atomic_write."""
    atomic_write(path, lambda f: torch.save(obj, f), keep_previous)


def copy_file(source: Path, path: Path):
    """path becomes a copy of source, in one rename: best.pt and epochN.pt are the bytes of their last.pt, copied,
    not pickled again (pickling the model objects is most of what a save costs)."""
    def copy(f):
        with open(source, 'rb') as src:
            shutil.copyfileobj(src, f, COPY_CHUNK)
    atomic_write(path, copy)


def load_checkpoint(path: Path, require_resume_state=False) -> dict:
    """torch.load of a run's own checkpoint (a trusted pickle), with the failure modes named; require_resume_state:
    refuse a final checkpoint, stripped of what a resume needs (but for an extension of the run, extend.py)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f'{path}: no such checkpoint')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f'{path} is truncated or corrupt ({type(e).__name__}: {str(e)[:120]})') from e
    if not isinstance(ckpt, dict) or 'model' not in ckpt:
        raise CheckpointError(f'{path} is not a YOLOv9 checkpoint (no model in it)')
    if require_resume_state:
        missing = [k for k in RESUME_KEYS if ckpt.get(k) is None]  # a final checkpoint is stripped of them
        if missing:
            raise FinalCheckpoint(f'{path} cannot be resumed: it lacks {", ".join(missing)} (a finished run\'s, '
                                  f'stripped: give --epochs beyond its total to train it further)')
    return ckpt


def load_for_resume(path: Path, log, stripped_ok=False) -> tuple:
    """(checkpoint, the file it came from): path, or the checkpoint it replaced when path is unusable; stripped_ok:
    a finished run's stripped last.pt too (extend.py)."""
    try:
        return load_checkpoint(path, require_resume_state=not stripped_ok), path
    except CheckpointError as error:
        previous = previous_path(path)
        if not previous.is_file():  # a finished run's final checkpoint has none: the finish removed it
            raise
        why = f'{path} is the run\'s final checkpoint, but the run stopped before its end was recorded' \
            if isinstance(error, FinalCheckpoint) else error
        log(f'WARNING: {why}; resuming from {previous} instead (one checkpoint earlier)')
        try:
            return load_checkpoint(previous, require_resume_state=not stripped_ok), previous
        except CheckpointError as second:
            raise CheckpointError(f'{error}; and {second}') from second


def load_everywhere(load) -> dict:
    """Rank 0 reads a checkpoint with load() and sends it to the others (nodes need not share a filesystem)."""
    ckpt, error = None, None
    if is_primary():
        try:
            ckpt = load()
        except CheckpointError as e:
            error = e
    raise_if_any_failed(error)
    return broadcast_object(ckpt)


def final_model(ckpt: dict):
    """What a final checkpoint is validated with: its EMA where it keeps one (train.py leaves best.pt unstripped), as
    upstream's attempt_load takes it."""
    return ckpt.get('ema') or ckpt['model']


def stripped(ckpt: dict) -> dict:
    """A final checkpoint as upstream's strip_optimizer leaves it: the EMA as the model, in half precision and frozen,
    without what only a resume needs."""
    ckpt = final_entries(ckpt)
    ckpt['model'].half()
    for parameter in ckpt['model'].parameters():
        parameter.requires_grad = False
    return ckpt


def final_entries(ckpt: dict) -> dict:
    """ckpt's entries as a final checkpoint holds them, in a new dict, its modules untouched: the EMA as the model,
    no optimizer, EMA or count of updates (the best fitness stays: an extension of the run needs it), epoch -1."""
    return {**ckpt, 'model': final_model(ckpt), 'optimizer': None, 'ema': None, 'updates': None, 'epoch': -1}


# -- the manager ------------------------------------------------------------------------------------------------------

class QueuedCheckpoint(QueuedHostCopy):
    """A trainer's checkpoint as a QueuedHostCopy, which calling completes in upstream's format wherever that runs:
    the grad scaler's numbers (hostcopy.scaler_numbers), the models in the default memory format, which upstream's
    fuse_conv_and_bn() (a .view) requires; strip: as a run's final checkpoint (stripped())."""

    def __init__(self, ckpt: dict, strip=False):
        super().__init__(final_entries(ckpt) if strip else ckpt)  # what a stripped file drops is not copied
        self.strip = strip

    def __call__(self) -> dict:
        ckpt = self.result()
        ckpt['scaler'] = scaler_numbers(ckpt['scaler'])
        for key in ('model', 'ema'):
            if ckpt[key] is not None:
                ckpt[key].to(memory_format=torch.contiguous_format)
        return stripped(ckpt) if self.strip else ckpt


class Checkpoints:
    """Rank 0's writer of a run's checkpoints: one write at a time, in a background thread, so that a slow disk never
    stalls training. A periodic checkpoint (skip_if_busy) due while a write runs is skipped, in one line: the next
    comes soon enough, and a queue behind a slow disk would only grow; any other save waits for it. A write that fails
    costs that checkpoint only, in one line. The thread is no daemon: a normal exit joins it."""

    def __init__(self, log, process=None, save=save_file):
        self.log = log  # one line per skipped or failed write
        self.process = process  # a writer.WriterProcess, which writes each QueuedCheckpoint
        self.save_file = save  # what writes a checkpoint into a file, in the writer process or the thread
        self.thread = None
        self.started = None  # time.monotonic() of the running write's start
        self.stripped_written = None  # the path of the last write, where it went out stripped (a run's final one)
        self.asked = time.monotonic()  # of the last save asked for, written or skipped (--checkpoint-minutes)

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start_process(self):
        """The writer process, started now, ahead of the first checkpoint; where it cannot be (WriterProcess says
        why), the thread writes from now on."""
        if self.process is not None and not self.process.start_if_needed():
            self.process = None

    def save(self, make, path: Path, name: str, then=(), skip_if_busy=False, strip=False) -> bool:
        """Write the checkpoint make() gives to path (keeping the file it replaces), stripped() with strip, then run
        each of then() in the writer thread once it is in place; name says which checkpoint this is ('checkpoint at
        epoch 3 step 1200'). Queues the host copy here; returns whether the write was started (make() is not called
        where it was not)."""
        self.asked = time.monotonic()
        if skip_if_busy and self.busy:
            self.log(f'{name} skipped: the previous write ({time.monotonic() - self.started:.1f} s so far) is still '
                     f'running')
            return False
        self.wait()
        self.start_process()  # again where it has ended; on the training thread, which the process's life follows
        copy = QueuedCheckpoint(make(), strip)
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self.write, args=(copy, Path(path), name, then),
                                       name='checkpoint-writer')
        self.thread.start()
        return True

    def write(self, copy: QueuedCheckpoint, path: Path, name: str, then):
        try:
            if self.process is not None:
                self.process.write(copy, path, self.save_file)
            else:
                self.save_file(copy(), path, keep_previous=True)
            self.stripped_written = path if copy.strip else None
            for step in then:
                step()
        except Exception as e:  # disk full, permissions: no partial file, and the checkpoints before it are intact
            detail = ' '.join(str(e).split())[:200]  # one line, whatever the error's text
            self.log(f'WARNING: {name} could not be written to {path} ({type(e).__name__}: {detail}); '
                     f'training goes on, and a resume takes the checkpoint before it')

    def wait(self):
        """Until the write under way (if any) has ended: before the next save, a run's end, a stop."""
        if self.thread is not None:
            self.thread.join()

    def close(self):
        """The end of training: the last write completes, then the writer process ends."""
        self.wait()
        if self.process is not None:
            self.process.close()

    def minutes_since_asked(self) -> float:
        return (time.monotonic() - self.asked) / 60

    def strip(self, source: Path, dest: Path):
        """dest becomes source stripped for use (stripped()), in one rename; source itself stays until then."""
        self.save_file(stripped(load_checkpoint(source)), dest)
