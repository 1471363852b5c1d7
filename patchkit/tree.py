"""A target tree: what it is, how far the series is applied, and how to change it all-or-nothing.

Every change goes through a journal: the original bytes of each file about to change are copied
into `.yolov9-ddp-journal/` and a manifest is committed (atomic rename) before the first byte of
the tree changes. A run that is killed half-way leaves the journal behind, and the next run puts
every file back from it before doing anything else. A lock on the tree's folder (flock, released
by the kernel when a process dies) keeps two appliers off one tree.
"""
import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.gitapply import git_apply, is_repository_root
from patchkit.pin import file_blob_id

YOLOV9_MARKERS = ('train_dual.py', 'val_dual.py', 'models/yolo.py', 'utils/general.py')
STATE_FILE = '.yolov9-ddp.json'
JOURNAL_DIR = '.yolov9-ddp-journal'
MANIFEST = 'manifest.json'


class TreeError(Exception):
    """A problem with the target tree; str() is the one-line cause, hint says what to do."""

    def __init__(self, message, hint=''):
        super().__init__(message)
        self.hint = hint


def check_is_yolov9_tree(target: Path):
    if not target.exists():
        raise TreeError(f'{target} does not exist', 'give the path of a clone of https://github.com/WongKinYiu/yolov9')
    if not target.is_dir():
        raise TreeError(f'{target} is not a folder', 'give the path of a clone of https://github.com/WongKinYiu/yolov9')
    missing = [m for m in YOLOV9_MARKERS if not (target / m).is_file()]
    if missing:
        raise TreeError(f'{target} is not a YOLOv9 tree (no {", ".join(missing)})',
                        'give the root folder of a clone of https://github.com/WongKinYiu/yolov9')


@contextlib.contextmanager
def tree_lock(target: Path):
    """Hold an exclusive lock on the target folder itself, so no file is created for it."""
    fd = os.open(target, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise TreeError(f'another apply_patches.py is working on {target}',
                                'wait for it to finish, then run this command again') from e
            raise
        yield
    finally:
        os.close(fd)


def read_state(target: Path) -> dict:
    """The record of the last apply (patches and installed files), or {} when there is none."""
    try:
        return json.loads((target / STATE_FILE).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise TreeError(f'{target / STATE_FILE} is unreadable ({e})',
                        'restore the file or remove it after checking the tree by hand') from e


def write_bytes_atomic(path: Path, data: bytes, mode: int = None):
    """Replace path with data in one rename; the file keeps its mode (a new one gets `mode` or the umask's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~current_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f'.{path.name}.', suffix='.tmp')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
        os.chmod(tmp, mode)  # mkstemp creates 0600 files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_file(target: Path, relative: str):
    """Delete target/relative and any folders that this leaves empty, up to the target."""
    path = target / relative
    path.unlink(missing_ok=True)
    for parent in path.parents:
        if parent == target or not parent.is_dir() or any(parent.iterdir()):
            break
        parent.rmdir()


@contextlib.contextmanager
def journaled(target: Path, paths):
    """Run the body as one all-or-nothing change of `paths` (relative to target)."""
    journal = target / JOURNAL_DIR
    journal.mkdir()
    originals = {}  # path -> file mode, or None for a file that did not exist
    for relative in sorted(set(paths)):
        source = target / relative
        originals[relative] = stat.S_IMODE(source.stat().st_mode) if source.is_file() else None
        if source.is_file():
            copy = journal / 'files' / relative
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy)
    write_bytes_atomic(journal / MANIFEST, json.dumps(originals, sort_keys=True).encode())
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
    restored = []
    manifest = journal / MANIFEST
    if manifest.is_file():  # without a manifest the change had not started: nothing to undo
        for relative, mode in json.loads(manifest.read_text()).items():
            if mode is not None:
                write_bytes_atomic(target / relative, (journal / 'files' / relative).read_bytes(), mode)
            else:
                remove_file(target, relative)
            restored.append(relative)
    shutil.rmtree(journal)
    return restored


@dataclass
class FileCheck:
    path: str
    expected: str  # pinned blob id
    found: str  # blob id in the tree, None when the file is missing
    committed: str = None  # blob id at HEAD, where the tree is a git repository

    @property
    def matches(self):
        return self.found == self.expected


@dataclass
class TreeState:
    kind: str  # 'pristine', 'applied', 'partial' or 'modified'
    applied: int  # how many leading patches of the series the tree holds
    files: list = field(default_factory=list)  # FileCheck for every touched file

    @property
    def differing(self):
        return [f for f in self.files if not f.matches]


def check_files(target: Path, pin) -> list:
    committed = head_blobs(target, pin.touched)
    return [FileCheck(path, expected, file_blob_id(target / path), committed.get(path))
            for path, expected in sorted(pin.touched.items())]


def head_blobs(target: Path, paths) -> dict:
    if not is_repository_root(target):
        return {}
    import git
    try:
        tree = git.Repo(target).head.commit.tree
    except (ValueError, git.GitError):  # a repository without commits
        return {}
    blobs = {}
    for path in paths:
        with contextlib.suppress(KeyError):
            blobs[path] = tree[path].hexsha
    return blobs


def copy_files(target: Path, paths, dest: Path):
    for relative in paths:
        if (target / relative).is_file():
            (dest / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(target / relative, dest / relative)


def applied_prefix(target: Path, pin, patches) -> int:
    """The k for which the touched files equal the pin plus patches[:k], or None.

    Each candidate k is tried on a scratch copy: reverse-apply patches k-1 .. 0 and compare every
    touched file with its pinned blob id.
    """
    paths = sorted(pin.touched) + sorted({f for p in patches for f in p.new_files})
    for k in range(len(patches), 0, -1):
        with tempfile.TemporaryDirectory(prefix='yolov9-ddp-state.') as scratch:
            scratch = Path(scratch)
            copy_files(target, paths, scratch)
            if all(git_apply(scratch, [p.path], '-R').ok for p in reversed(patches[:k])) and \
                    all(file_blob_id(scratch / path) == blob for path, blob in pin.touched.items()):
                return k
    return None


def is_committed_revision(target: Path, files) -> bool:
    """The touched files are exactly as HEAD of a git repository has them, and HEAD's are not the pin's.

    Such a tree is another upstream revision, whatever it shares with the series: apply_patches.py
    never leaves part of the series in a tree (every change is all-or-nothing), so a committed prefix of
    the series is upstream (or someone) having merged those fixes, not a half-applied series.
    """
    return (is_repository_root(target) and all(f.found == f.committed for f in files)
            and any(f.committed != f.expected for f in files))


def inspect_tree(target: Path, pin, patches) -> TreeState:
    """'pristine' (the pin), 'applied' (pin + the whole series), 'partial' (pin + a prefix of the series,
    unless is_committed_revision) or 'modified' (anything else: another upstream revision, or edits).

    A folder without .git that holds pin + a prefix cannot be told from another upstream revision that
    merged those fixes; it is reported 'partial', and apply_patches.py --check names both readings.
    """
    files = check_files(target, pin)
    if all(f.matches for f in files):
        return TreeState('pristine', 0, files)
    k = applied_prefix(target, pin, patches)
    if k == len(patches):
        return TreeState('applied', k, files)
    if k and not is_committed_revision(target, files):
        return TreeState('partial', k, files)
    return TreeState('modified', 0, files)
