"""Two pytest-xdist workers on 2 cores: a test that checks durations or deadlines against the clock (marked `timed`)
has the machine to itself, so that what it measures is a machine that runs one job; the other tests run two at a
time. A job of several processes waits in collectives, start-up and restarts for a third of its time, so two such
tests side by side keep the cores busy that one alone leaves idle. A test that starts one must say so (marked
`cores`, or `slow` without `one_core`): jobs.torchrun_cmd refuses it to the others.

A reader-writer lock on two files shared by the workers of one run, writer-preferring: a timed test waits for the
test already running while holding the gate, so no new test starts beside it in the meantime."""
import collections
import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

SLOW_WEIGHT = 10  # a slow test took 4 s or more, most fast ones well under 1 s
SHARE = 'YOLOV9_TEST_CORES'  # 'machine', 'jobs' or 'one process': the running test's (jobs.torchrun_cmd checks it)


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


def marks(item) -> set:
    return {mark.name for mark in item.iter_markers()}


def machine_wide(item) -> bool:
    return 'timed' in marks(item)


def runs_jobs(item) -> bool:
    """Whether item may start jobs of several processes."""
    marked = marks(item)
    return 'timed' in marked or 'cores' in marked or ('slow' in marked and 'one_core' not in marked)


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
    os.environ[SHARE] = 'machine' if machine_wide_test else 'jobs' if runs_jobs(item) else 'one process'
    try:
        with contextlib.ExitStack() as held:
            with flocked(folder / 'gate', fcntl.LOCK_EX):  # no new test passes a machine-wide one waiting here
                held.enter_context(flocked(folder / 'cores', fcntl.LOCK_EX if machine_wide_test else fcntl.LOCK_SH))
            yield
    finally:
        del os.environ[SHARE]


def check_runs_jobs(nproc: int):
    """A test that says it runs one process at a time must not start more: the other worker's test counts on it."""
    if nproc > 1 and os.environ.get(SHARE) == 'one process':
        raise AssertionError(f'a test that runs {nproc} processes must be marked cores, or slow without one_core '
                             f'(testsupport/cores.py)')
