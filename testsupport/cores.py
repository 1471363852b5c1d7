"""Two pytest-xdist workers on 2 cores, without oversubscribing them: a test that runs multi-process jobs (marked
`cores`, or `slow` without `one_core`) has the machine to itself, while the other tests run two at a time. Their
timings, and the deadlines the fault tests derive from them, stay those of a machine that runs one job.

A reader-writer lock on two files shared by the workers of one run, writer-preferring: a machine-wide test waits
for the tests already running while holding the gate, so no new test starts beside it in the meantime."""
import collections
import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

SLOW_WEIGHT = 10  # a slow test took 4 s or more, most fast ones well under 1 s
SHARE = 'YOLOV9_TEST_CORES'  # 'machine' or 'shared': what the running test holds (jobs.torchrun_cmd checks it)


FOLDER = 'YOLOV9_TEST_LOCKS'  # the lock folder of a run: made by its controller, inherited by its workers
made = []  # the lock folder this process made


def make_lock_folder():
    """The controller's, before its workers start (pytest_configure), unless a run around it made one already;
    remove_lock_folder() at the run's end removes the one it made."""
    if FOLDER not in os.environ:
        os.environ[FOLDER] = tempfile.mkdtemp(prefix='yolov9-ddp-cores-')
        made.append(os.environ[FOLDER])


def remove_lock_folder():
    while made:
        shutil.rmtree(made.pop(), ignore_errors=True)
        del os.environ[FOLDER]


def lock_folder() -> Path:
    return Path(os.environ[FOLDER])


@contextlib.contextmanager
def flocked(path: Path, mode: int):
    with open(path, 'a') as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def machine_wide(item) -> bool:
    marked = {mark.name for mark in item.iter_markers()}
    return 'cores' in marked or ('slow' in marked and 'one_core' not in marked)


def sharing_modules_first(items: list) -> list:
    """items with the modules whose tests share the machine first (a slow test weighing SLOW_WEIGHT fast ones): two
    workers then run those side by side, and a module that shares is not left alone at the end of the run with the
    other worker idle. pytest-xdist (--dist loadfile --no-loadscope-reorder) hands out the modules in this order."""
    weights = collections.defaultdict(lambda: [0, 0])  # module: [weight of its sharing tests, of all its tests]
    for item in items:
        weight = SLOW_WEIGHT if item.get_closest_marker('slow') else 1
        weights[item.module][0] += 0 if machine_wide(item) else weight
        weights[item.module][1] += weight
    return sorted(items, key=lambda item: -weights[item.module][0] / weights[item.module][1])


@contextlib.contextmanager
def cores_for(item):
    """Hold the machine (or a share of it) while item runs; nothing to hold without xdist."""
    machine_wide_test = machine_wide(item)
    if 'PYTEST_XDIST_WORKER' not in os.environ:
        yield
        return
    folder = lock_folder()
    os.environ[SHARE] = 'machine' if machine_wide_test else 'shared'
    try:
        with contextlib.ExitStack() as held:
            with flocked(folder / 'gate', fcntl.LOCK_EX):  # no new test passes a machine-wide one waiting here
                held.enter_context(flocked(folder / 'cores', fcntl.LOCK_EX if machine_wide_test else fcntl.LOCK_SH))
            yield
    finally:
        del os.environ[SHARE]


def check_machine_wide(nproc: int):
    """A test running a multi-process job beside another test would slow both and make deadlines flaky."""
    if nproc > 1 and os.environ.get(SHARE) == 'shared':
        raise AssertionError(f'a test that runs {nproc} processes must be marked cores, or slow without one_core '
                             f'(testsupport/cores.py)')
