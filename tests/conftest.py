"""The fixtures of the yolov9-ddp tests. Plain helpers live in the package testsupport/ (shared with bench/):
trees.py (the pinned upstream, copies, snapshots, subprocesses), jobs.py (torchrun jobs and probes),
faults.py (the fault scenarios)."""
import os
import sys
from pathlib import Path

import pytest
from filelock import FileLock

KIT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(KIT))  # the kit's packages (patchkit, yolov9_ddp) and testsupport

from patchkit.pin import read_pin  # noqa: E402
from testsupport.cores import (cores_for, in_scheduling_order, make_lock_folder, remove_lock_folder,  # noqa: E402
                               timed_together)
from testsupport.trees import (DEMO_SPEC, PATCHES, SERIES, TINY_CFG, copy_tree, describe, git_apply,
                               offline_environment, patch_files, pinned_upstream_root,
                               run_applier, snapshot)
from testsupport.jobs import TASK_DATASETS  # noqa: E402
from yolov9_ddp.demo_data import ensure_demo_dataset  # noqa: E402


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
    root = pinned_upstream_root(pin)
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
def run_folder(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this run shares (each worker's own base temp lies in it): what is
    built there under a file lock is built once per run, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if 'PYTEST_XDIST_WORKER' in os.environ else base


@pytest.fixture(scope='session')
def task_datasets(run_folder) -> dict:
    """{'boxes': data.yaml, 'polygons': data.yaml}: the generated datasets of TASK_DATASETS."""
    with FileLock(run_folder / 'task-datasets.lock'):
        return {kind: ensure_demo_dataset(run_folder / 'task-datasets' / kind, spec, log=lambda msg: None)
                for kind, spec in TASK_DATASETS.items()}


@pytest.fixture(scope='session')
def tree_without(pinned_upstream, tmp_path_factory):
    """tree_without(n): a copy of the pin with every patch of the series applied except patch n, and except the later
    patches whose context holds lines of patch n (they cannot apply without it; each must share a file with it)."""
    built = {}

    def build(number: int) -> Path:
        if number not in built:
            skipped = next(name for name in SERIES if name.startswith(f'{number:04d}-'))
            tree = copy_tree(pinned_upstream, tmp_path_factory.mktemp(f'without-{number:04d}') / 'yolov9')
            for name in (n for n in SERIES if n != skipped):
                result = git_apply(tree, [PATCHES / name])
                if result.returncode:
                    assert name > skipped and patch_files(name) & patch_files(skipped), \
                        f'the series without {skipped} does not apply at {name}: {result.stderr}'
            built[number] = tree
        return built[number]

    return build


# -- two workers on two cores (pytest -n 2, as run-tests.sh runs the suite) -----------------------------------

def pytest_configure(config):
    if 'PYTEST_XDIST_WORKER' not in os.environ:  # the controller (or a run without workers): not a worker
        make_lock_folder()


def pytest_unconfigure(config):
    if 'PYTEST_XDIST_WORKER' not in os.environ:
        remove_lock_folder()


def pytest_collection_modifyitems(items):
    items[:] = in_scheduling_order(items)  # testsupport/cores.py


@pytest.hookimpl(optionalhook=True)  # a run without pytest-xdist (-p no:xdist) has no such hook
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue('dist') == 'loadfile':
        return timed_together(config, log)  # testsupport/cores.py


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A timed test runs beside no other job, its fixtures included (testsupport/cores.py)."""
    with cores_for(item):
        return (yield)
