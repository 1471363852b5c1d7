"""Every file the kit writes goes through atomic_write: a temporary file beside its destination, flushed to disk, then
moved into place with os.replace (as timm's CheckpointSaver), so that a crash at any moment leaves the file before or
the file after, never a part of one; and whoever reads it meanwhile (torchrun an error file, another rank opt.yaml)
finds it whole."""
import os
from pathlib import Path


def atomic_write(path: Path, write, keep_previous=False):
    """write(f) into a temporary file beside path (f.name names it), flushed to disk, then moved into place in one
    rename; with keep_previous the file it replaces stays as previous_path(path)."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, 'wb') as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_path(path))  # a crash right after this leaves the previous one to resume from
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync(path.parent)  # the rename itself is only durable once the folder entry is on disk


def temporary_path(path: Path) -> Path:
    """Where a writer of path puts its bytes before the rename: hidden, per process (remove_stale_temporaries)."""
    return path.with_name(f'.{path.name}.{os.getpid()}.tmp')


def previous_path(path: Path) -> Path:
    """Where atomic_write(keep_previous=True) keeps the file it replaced: last.pt -> last.previous.pt."""
    return path.with_name(f'{path.stem}.previous{path.suffix}')


def fsync(path: Path):
    """Flush a file's bytes, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(folder: Path):
    """Temporary files of writers that were killed before their os.replace."""
    for tmp in Path(folder).glob('.*.tmp'):
        tmp.unlink(missing_ok=True)
