"""Checkpoints: written whole or not at all, and read back with a clear error when they are not usable.

A checkpoint is written to a temporary file beside its destination, flushed to disk, then moved
into place with os.replace (as timm's CheckpointSaver): a crash at any moment leaves either the
previous file or the new one, never a truncated one. The format is upstream's (the model objects
are pickled, so upstream's val_dual.py, detect_dual.py and attempt_load() read our files), plus
what an exact resume needs: the grad scaler and the kit's format version.
"""
import os
import pickle
import zipfile
from pathlib import Path

import torch

from yolov9_ddp.comm import Unanimous

FORMAT = 'yolov9-ddp/1'
RESUME_KEYS = ('epoch', 'model', 'ema', 'updates', 'optimizer', 'opt')


class CheckpointError(Exception):
    """A checkpoint file that cannot be used; the message names the file and the reason."""


class ModelMismatch(CheckpointError, Unanimous):
    """A resume checkpoint of another model: every rank finds it loading the same weights."""


def save_atomic(obj, path: Path, keep_previous=False):
    """Write obj to path in one rename; with keep_previous the file it replaces stays as previous_path(path)."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_path(path))  # a crash right after this leaves the previous one to resume from
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def temporary_path(path: Path) -> Path:
    """Where a writer of path puts its bytes before the rename: hidden, per process (remove_stale_temporaries)."""
    return path.with_name(f'.{path.name}.{os.getpid()}.tmp')


def previous_path(path: Path) -> Path:
    """Where save_atomic(keep_previous=True) keeps the checkpoint it replaced: last.pt -> last.previous.pt."""
    return path.with_name(f'{path.stem}.previous{path.suffix}')


def fsync_dir(folder: Path):
    # the rename itself is only durable once the folder entry is on disk
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(folder: Path):
    """Temporary files of writers that were killed before their os.replace."""
    for tmp in Path(folder).glob('.*.tmp'):
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: Path, require_resume_state=False) -> dict:
    """torch.load of a run's own checkpoint (a trusted pickle), with the failure modes named."""
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
            raise CheckpointError(f'{path} cannot be resumed: it lacks {", ".join(missing)} '
                                  f'(a stripped final checkpoint?)')
    return ckpt


def load_for_resume(path: Path, log) -> tuple:
    """(checkpoint, the file it came from): path, or the checkpoint it replaced when path is unusable."""
    try:
        return load_checkpoint(path, require_resume_state=True), path
    except CheckpointError as error:
        previous = previous_path(path)
        if not previous.is_file():
            raise
        log(f'WARNING: {error}; resuming from {previous} instead (one checkpoint earlier)')
        try:
            return load_checkpoint(previous, require_resume_state=True), previous
        except CheckpointError as second:
            raise CheckpointError(f'{error}; and {second}') from second
