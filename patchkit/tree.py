"""A target tree on disk: is it YOLOv9, its lock, its record of what the kit applied, and all-or-nothing changes.

Every change goes through a journal: each file about to change is copied into `.yolov9-ddp-journal/` and a
manifest committed (atomic rename) before the first byte changes; a run killed half-way leaves it behind, and the
next run puts every file back first. A lock (filelock: released by the system when a process dies) keeps two
appliers off one tree.
"""
import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import filelock

YOLOV9_MARKERS = ('train_dual.py', 'val_dual.py', 'models/yolo.py', 'utils/general.py')
STATE_FILE = '.yolov9-ddp.json'
JOURNAL_DIR = '.yolov9-ddp-journal'
EXCLUDE_START = '# yolov9-ddp: files apply_patches.py installed (apply_patches.py --revert removes these lines)'
EXCLUDE_BLOCK = re.compile(r'^# yolov9-ddp: .*?^# end of yolov9-ddp\n', re.M | re.S)


class TreeError(Exception):
    """A problem with the target tree; str() is the one-line cause, hint says what to do, drift explains it."""

    def __init__(self, message, hint='', drift=None):
        super().__init__(message)
        self.hint, self.drift = hint, drift


def check_is_yolov9_tree(target: Path):
    missing = [m for m in YOLOV9_MARKERS if not (target / m).is_file()]
    if missing:
        problem = 'is not a folder' if target.is_file() else 'does not exist' if not target.exists() else \
            f'is not a YOLOv9 tree (no {", ".join(missing)})'
        raise TreeError(f'{target} {problem}', 'give the root folder of a clone of github.com/WongKinYiu/yolov9')


def lock_path(target: Path) -> Path:
    """The lock file of a target: in the temporary folder, so that the tree itself gains no file."""
    return Path(tempfile.gettempdir()) / f'yolov9-ddp-{hashlib.sha1(str(target).encode()).hexdigest()[:16]}.lock'


@contextlib.contextmanager
def tree_lock(target: Path):
    path = lock_path(target)
    lock = filelock.FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout as e:  # a subclass of OSError: first
        raise TreeError(f'another apply_patches.py is working on {target}',
                        'wait for it to finish, then run this command again') from e
    except OSError as e:  # filelock refuses a lock file of another account in a shared temporary folder
        raise TreeError(f'cannot take the lock {path} ({e.strerror or e})',
                        'if another account applied the kit to this tree, run this command as that account, or let '
                        'it (or root) remove the file, which holds no data, while no apply_patches.py runs') from e
    try:
        yield
    finally:
        lock.release()


def read_state(target: Path) -> dict:
    """The record of the last apply, or {} when there is none."""
    try:
        return json.loads((target / STATE_FILE).read_text(encoding='utf-8'))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise TreeError(f'{target / STATE_FILE} is unreadable ({e})',
                        'restore the file or remove it after checking the tree by hand') from e


def write_bytes_atomic(path: Path, data: bytes):
    """Replace path with data in one rename; the file keeps its mode (a new one gets the umask's, as any file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f'.{path.name}.{os.getpid()}.tmp')
    try:
        tmp.write_bytes(data)
        if path.exists():
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_file(target: Path, relative: str):
    """Delete target/relative and any folders that this leaves empty, up to the target."""
    path = target / relative
    path.unlink(missing_ok=True)
    for parent in path.parents:
        if parent == target or not parent.is_dir() or any(parent.iterdir()):
            break
        parent.rmdir()


def exclude_text(text: str, entries) -> str:
    """A .git/info/exclude text with the kit's block replaced by `entries` (none: the block removed)."""
    kept = EXCLUDE_BLOCK.sub('', text)
    block = ''.join(f'{line}\n' for line in [EXCLUDE_START, *entries, '# end of yolov9-ddp']) if entries else ''
    return kept + ('\n' if kept and not kept.endswith('\n') and block else '') + block


@contextlib.contextmanager
def journaled(target: Path, paths):
    """Run the body as one all-or-nothing change of `paths` (relative to target; '..' may lead into .git)."""
    journal = target / JOURNAL_DIR
    journal.mkdir()
    manifest = [[relative, (target / relative).is_file()] for relative in sorted(set(paths))]  # [path, existed]
    for number, (relative, existed) in enumerate(manifest):
        if existed:
            shutil.copy2(target / relative, journal / str(number))  # bytes and mode
    write_bytes_atomic(journal / 'manifest.json', json.dumps(manifest).encode())
    try:
        yield
    except BaseException:
        restore_from_journal(target)
        raise
    shutil.rmtree(journal)


def restore_from_journal(target: Path) -> list:
    """Undo an interrupted change; returns the restored paths ([] when there was no journal)."""
    journal = target / JOURNAL_DIR
    if not journal.exists():
        return []
    manifest_file = journal / 'manifest.json'  # without one, the change had not started: nothing to undo
    manifest = json.loads(manifest_file.read_text()) if manifest_file.is_file() else []
    if isinstance(manifest, dict):  # kit 0.1.0's journal: {path: mode, None for a new file}, copies in files/PATH
        copies = {path: mode is not None and journal / 'files' / path for path, mode in manifest.items()}
    else:
        copies = {path: existed and journal / str(number) for number, (path, existed) in enumerate(manifest)}
    for relative, copy in copies.items():
        if copy:  # copied, not moved: a restore cut short is simply done again
            write_bytes_atomic(target / relative, copy.read_bytes())
            shutil.copymode(copy, target / relative)
        else:
            remove_file(target, relative)
    shutil.rmtree(journal)
    return list(copies)
