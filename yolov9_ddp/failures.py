"""How a process of the job ends when something goes wrong: promptly, with one line naming the cause, recorded
where torchrun looks for it, and with none of its loader workers left behind.

A loader worker killed by the kernel's out-of-memory killer, a dataset or a loss that raises, a CUDA out-of-memory
error: each surfaces as an exception on one rank. That rank reports it, ends its loader workers and exits; torchrun
sees the exit and restarts the job (--max-restarts) or stops the other ranks, which would otherwise wait in a
collective until --ddp-timeout. Loader workers ignore SIGTERM (they leave signals to their trainer, see
yolov9_ddp.data.init_worker), so nothing may wait for them to obey one: multiprocessing's exit handler sends them
SIGTERM and joins them, and a trainer whose persistent validation worker outlived its iterator hung there for good
(yolov9-ddp issue 11). They are ended with SIGKILL once their trainer no longer needs them, and the kernel ends
them if their trainer dies first.
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
    """In a forked child (a loader worker, the checkpoint writer): the kernel SIGKILLs it the moment the thread that
    forked it dies (Linux), where torch's own watchdog would notice a worker's loss only between batches, at most
    every 5 s. Workers started by a forkserver or spawn have another parent (the server): left to that watchdog."""
    if sys.platform != 'linux' or os.getppid() != parent_pid:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        os._exit(1)


def end_children():
    """SIGKILL this process's child processes that are still alive (loader workers its trainer is done with) and
    reap them. torch's SIGCHLD handler, which raises in the trainer when a registered worker dies, is held off
    meanwhile: these deaths are intended. It ignores workers that are already reaped afterwards."""
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
    """Exit with main()'s status; once the run has succeeded (0), without the interpreter's teardown. That teardown
    only frees memory here but frees torch's C++ objects while Python is being dismantled, and a C++ destructor that
    runs then can abort a process whose work is done: in the kit's CI (2026-12-01) a rank whose run had completed
    died of 'terminate called without an active exception' (SIGABRT) on its way out, and torchrun reported the
    finished run as failed (with --max-restarts it would have started it again). torch's own
    destroy_process_group names the hazard (a destructor that finishes after the interpreter exits).

    A failed rank exits normally (for an error every rank saw alike, only once its node's reporter has its line
    out: wait_for_the_node_reporter)."""
    if status != 0:
        sys.exit(status)
    exit_without_teardown(0)


def exit_without_teardown(status: int):
    """Everything a normal exit does before the interpreter's teardown, in its order: other threads are joined, the
    atexit handlers run (logging's flush, the end of the loader workers, multiprocessing's), the standard streams are
    flushed; then the exit. The teardown of a process that imported torch takes 0.5 to 1 s of CPU."""
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
    """Return once this node's first process (LOCAL_RANK 0) has recorded its error file, or after timeout_s.

    For an error every process sees alike, one process prints the line and records its file after printing; the
    others only record theirs. torchrun stops every process of the job as soon as one exits, so a silent process
    that exited first would have the reporter stopped before its line is out: it waits for the reporter's file
    (torchrun's layout: .../attempt_N/LOCAL_RANK/error.json). Without torchrun's files there is nothing to wait for."""
    own, local_rank = os.environ.get('TORCHELASTIC_ERROR_FILE'), os.environ.get('LOCAL_RANK')
    if not own or local_rank in (None, '0') or Path(own).parent.name != local_rank:
        return
    reporter = Path(own).parents[1] / '0' / Path(own).name
    deadline = time.monotonic() + timeout_s
    while not reporter.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def record_for_torchrun(message: str, consequence=False):
    """Write message where torchrun looks for a failed worker's cause (TORCHELASTIC_ERROR_FILE, in the format of
    torch.distributed.elastic's error files): its summary then shows this line instead of `error_file: <N/A>`.

    The summary's root cause is the failure of the earliest timestamp, in whole seconds, the lowest rank on a tie. A
    consequence (this rank failed because another did) is dated a second later: the cause is recorded before its
    process exits, which is what the other ranks notice, so it comes first even within the same second (rank 0
    stopped by rank 1's death was named the root cause whenever both fell in one second).

    The file appears whole, by a rename. torchrun parses the file of every worker it finds gone, those it has just
    stopped too, and a file opened (truncated) but not yet written ends the whole job in a JSONDecodeError instead
    of a restart: in the kit's CI (2026-12-06) a job with --max-restarts 1 ended so at its first fault."""
    path = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if not path:
        return
    record = json.dumps({'message': message, 'timestamp': str(int(time.time()) + (1 if consequence else 0))})
    try:
        atomic_write(path, lambda f: f.write(record.encode()))
    except OSError:  # the cause is on stderr as well; a failure to record it must not hide it
        pass
