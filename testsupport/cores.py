"""Two pytest-xdist workers on 2 cores. A test of a multi-process job (marked `cores`, or `slow` without
`one_core`) runs beside another, since a job waits in collectives, start-up and restarts for a third of its time;
jobs.torchrun_cmd refuses one to a test not marked so. A test that checks durations or tight deadlines on the clock
(marked `timed`) runs beside no other job, only beside a test of one process. Modules of jobs run first, two at a
time; then one worker takes the timed tests, one group, while the other runs the modules of one process.

A reader-writer lock on two files shared by the workers of one run, writer-preferring: a timed test waits for the
job test already running while holding the gate, so no new job test starts beside it in the meantime."""
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


TIMED_GROUP = 'timed'


def in_scheduling_order(items: list) -> list:
    """items in the order the workers get them: the modules with jobs first (a slow test weighing SLOW_WEIGHT fast
    ones, the heaviest share first), then the timed tests, then the modules of one process, which run beside them.
    The timed tests' ids go to the lock folder, where the controller's timed_together() reads them."""
    weights = collections.defaultdict(int)  # module: the weight of its tests that run jobs but are not timed
    for item in items:
        if runs_jobs(item) and not machine_wide(item):
            weights[item.module] += SLOW_WEIGHT if item.get_closest_marker('slow') else 1
    if FOLDER in os.environ:
        timed = lock_folder() / TIMED_GROUP
        temporary = timed.with_name(f'{TIMED_GROUP}.{os.getpid()}')  # both workers write the same list
        temporary.write_text(''.join(f'{item.nodeid}\n' for item in items if machine_wide(item)))
        temporary.replace(timed)

    def phase(item):
        return (1, 0) if machine_wide(item) else (0, -weights[item.module]) if weights[item.module] else (2, 0)
    return sorted(items, key=phase)


def timed_together(config, log):
    """--dist loadfile's scheduler, but the timed tests are one unit of work, which one worker runs while the other
    runs the tests of one process beside it. (pytest-xdist's loadgroup would do, but pytest 9 ignores the ids it
    sets.)"""
    from xdist.scheduler import LoadScopeScheduling  # bench/ imports testsupport where pytest-xdist is not

    class TimedTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if not hasattr(self, 'timed'):  # read once the workers have collected
                self.timed = set((lock_folder() / TIMED_GROUP).read_text().splitlines())
            return TIMED_GROUP if nodeid in self.timed else nodeid.split('::', 1)[0]
    return TimedTogether(config, log)


@contextlib.contextmanager
def cores_for(item):
    """Hold the machine (or a share of it) while item runs; nothing to hold without xdist."""
    machine_wide_test, jobs = machine_wide(item), runs_jobs(item)
    if 'PYTEST_XDIST_WORKER' not in os.environ:
        yield
        return
    folder = lock_folder()
    os.environ[SHARE] = 'machine' if machine_wide_test else 'jobs' if jobs else 'one process'
    try:
        with contextlib.ExitStack() as held:
            if jobs:  # a test of one process holds nothing
                with flocked(folder / 'gate', fcntl.LOCK_EX):  # no new job test passes a timed one waiting here
                    held.enter_context(flocked(folder / 'cores',
                                               fcntl.LOCK_EX if machine_wide_test else fcntl.LOCK_SH))
            yield
    finally:
        del os.environ[SHARE]


def check_runs_jobs(nproc: int):
    """A test that says it runs one process at a time must not start more: the other worker's test counts on it."""
    if nproc > 1 and os.environ.get(SHARE) == 'one process':
        raise AssertionError(f'a test that runs {nproc} processes must be marked cores, or slow without one_core '
                             f'(testsupport/cores.py)')
