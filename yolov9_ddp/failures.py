"""How a process of the job ends when something goes wrong: promptly, with one line naming the cause, recorded
where torchrun looks for it, and with none of its loader workers left behind.

A killed loader worker, a dataset or a loss that raises, CUDA out of memory: each surfaces on one rank, which reports
it, ends its workers and exits, so that torchrun restarts the job or stops the ranks that would otherwise wait in a
collective until --ddp-timeout. Loader workers ignore SIGTERM (data.init_worker), so nothing may wait for them to obey
one, as multiprocessing's exit handler does: they are SIGKILLed, and the kernel ends them if their trainer dies.
"""
import atexit
import ctypes
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from yolov9_ddp.files import atomic_write

# how gloo words a peer process that is gone; NCCL's watchdog ends the process itself
PEER_GONE = ('connection closed by peer', 'connection reset by peer')
TIMED_OUT = ('timed out', 'timeout')
PR_SET_PDEATHSIG = 1  # prctl(2): the signal the kernel sends this process when its parent dies
REAP_TIMEOUT_S = 10
REPORTER_WAIT_S = 10  # how long a rank waits for its node's first process to have its one line out


def die_with_parent(parent_pid: int):
    """In a forked child (a loader worker, the checkpoint writer): SIGKILLed by the kernel the moment the thread that
    forked it dies, where torch's watchdog would notice only between batches. A forkserver's or spawn's child has
    another parent: left to that watchdog."""
    if sys.platform != 'linux' or os.getppid() != parent_pid:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        os._exit(1)


def end_children():
    """SIGKILL and reap this process's live children (loader workers it is done with), torch's SIGCHLD handler held
    off meanwhile: these deaths are intended."""
    children = multiprocessing.active_children()
    if not children:
        return
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        for child in children:
            child.kill()
        for child in children:
            child.join(REAP_TIMEOUT_S)
    finally:
        signal.signal(signal.SIGCHLD, previous)


def end_children_at_exit():
    """Whatever way the interpreter exits, end the children first. atexit runs its functions last-registered first,
    so this runs before multiprocessing's own handler, which would join workers that ignore its SIGTERM."""
    atexit.register(end_children)


def end_process(status: int):
    """Exit with main()'s status; a run that succeeded without the interpreter's teardown, which frees torch's C++
    objects while Python is dismantled: a destructor then can abort a process whose work is done ('terminate called
    without an active exception'), and torchrun would report the finished run as failed."""
    if status != 0:
        sys.exit(status)
    exit_without_teardown(0)


def exit_without_teardown(status: int):
    """What a normal exit does before the teardown, in its order: other threads joined, atexit handlers run, the
    standard streams flushed; then the exit."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (the reader is gone): nothing left to say there
            pass
    os._exit(status)


def cause(error: BaseException) -> tuple:
    """(one line naming why this rank failed, with what to do where the cause is a known one; whether the
    traceback would help: for a bug yes, for a killed worker or a full GPU no)."""
    text = str(error).strip()
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return (f'out of GPU memory ({first_line(text)[:200]}); lower --batch-size or --imgsz, '
                f'or free the GPU of other processes'), False
    if isinstance(error, RuntimeError) and text.startswith('DataLoader worker'):
        return (f'{first_line(text)} A loader worker is most often killed by the kernel\'s out-of-memory killer '
                f'(see dmesg): lower --workers, --batch-size or drop --cache ram'), False
    if text.startswith('Caught ') and 'in DataLoader worker process' in text:  # re-raised from a worker
        return f'{text.splitlines()[-1].strip()[:300]} (in a DataLoader worker, {where(error)})', True
    return f'{type(error).__name__}: {first_line(text)[:300]} ({where(error)})', True


def collective_failure(error: BaseException, ddp_timeout: float):
    """The one line for a collective that failed because a peer died or a rank stalled; None for other errors."""
    text = first_line(str(error))
    lowered = text.lower()
    if any(w in lowered for w in PEER_GONE):
        detail = text.split('] ', 1)[-1].split('. This is typically')[0]  # gloo's own words, without its source file
        return f'a collective operation failed: another rank died or failed ({detail}); its error line says why'
    if isinstance(error, torch.distributed.DistError) or any(w in lowered for w in TIMED_OUT):
        return (f'a collective operation failed or timed out ({text[:200]}); a rank may have died or stalled; '
                f'the limit is --ddp-timeout {ddp_timeout:g} s')
    return None


def first_line(text: str) -> str:
    return text.splitlines()[0].strip() if text else ''


def where(error: BaseException) -> str:
    """file:line of the innermost frame the error passed through (the place a bug report needs)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return 'no traceback'
    frame = frames[-1]
    return f'at {Path(frame.filename).name}:{frame.lineno} in {frame.name}'


def wait_for_the_node_reporter(timeout_s: float = REPORTER_WAIT_S):
    """Return once this node's first process, which prints an error every process sees alike (or its own, where the
    others stopped because it failed), has recorded its error file (torchrun's .../attempt_N/LOCAL_RANK/error.json),
    or after timeout_s: torchrun stops the whole job when one process exits, and a silent one exiting first would cut
    the reporter's line off."""
    own, local_rank = os.environ.get('TORCHELASTIC_ERROR_FILE'), os.environ.get('LOCAL_RANK')
    if not own or local_rank in (None, '0') or Path(own).parent.name != local_rank:
        return
    reporter = Path(own).parents[1] / '0' / Path(own).name
    deadline = time.monotonic() + timeout_s
    while not reporter.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def record_for_torchrun(message: str, consequence=False):
    """Write message where torchrun looks for a failed worker's cause (TORCHELASTIC_ERROR_FILE), so that its summary
    shows this line. Its root cause is the earliest timestamp, in whole seconds: a consequence (this rank failed
    because another did) is dated a second later. The file appears whole, by a rename: torchrun parses the file of
    every worker it stopped, and a truncated one would end the job in a JSONDecodeError instead of a restart."""
    path = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if not path:
        return
    record = json.dumps({'message': message, 'timestamp': str(int(time.time()) + (1 if consequence else 0))})
    try:
        atomic_write(path, lambda f: f.write(record.encode()))
    except OSError:  # the cause is on stderr as well; a failure to record it must not hide it
        pass
