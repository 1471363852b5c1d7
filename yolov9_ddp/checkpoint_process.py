"""The lever checkpoint_process: rank 0's periodic checkpoints completed and written by a child process.

CheckpointWriter's thread shares the interpreter's lock with the training thread, and most of a write is Python
holding it: torch.save asks its persistent_id about each pickled object, about 288,000 for yolov9-s, its EMA and
the SGD state. On an H100 each periodic checkpoint cost training 0.7 to 0.9 s, of which the training thread's own
half was 0.23 to 0.35 s (bench/RESULTS.md, seventh session). With this lever the writer's thread only hands the
queued host copy over a pipe (the lock let go while it waits), and a child process rebuilds the checkpoint and
writes it as the thread would (QueuedCheckpoint, save_atomic): the same file.

The child is started on the training thread as training is set up, and imports then what unpickling the first
checkpoint would: torch, and the modules of the model's classes it is given (upstream's models.yolo takes 1.9 s on a
2-core CPU: the first checkpoint was in place 2.8-3.1 s after it was queued before, 0.5-0.6 s now,
bench/RESULTS.md). It is started again, in one line, at a checkpoint where it has ended; it dies with the process
that started it (PR_SET_PDEATHSIG, so a SIGKILLed rank leaves no writer behind to finish a file its restart does not
expect) and ends when CheckpointWriter.close() tells it to (a message, not the pipe's end: the loader's workers,
forked after it started, hold copies of the pipe's ends). Where none can start, or GIVE_UP_AFTER in a row end while
writing, the writer's thread writes the checkpoints from then on, after one line: a lever that saves time must never
cost every checkpoint.

    python -m yolov9_ddp.checkpoint_process JOBS_FD REPLIES_FD PARENT_PID [MODULE ...]   (the child: WriterProcess's)
"""
import ctypes
import importlib
import os
import pickle
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from yolov9_ddp import shutdown
from yolov9_ddp.checkpoint import QueuedCheckpoint, save_atomic

PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_WAIT_S = 30
STOP = 'stop'  # the last message a child gets
GIVE_UP_AFTER = 2  # children in a row that ended while writing


class WriterProcessEnded(Exception):
    """The child ended before it answered: the checkpoint it was given is not written."""


class WriterProcess:
    """The parent's end, as CheckpointWriter's process: start_if_needed() on the training thread, write() in the
    writer's thread, close() at the end. preload: the modules a checkpoint's classes come from (Task.model_module),
    which the child imports as it starts."""

    def __init__(self, log, preload=()):
        self.log, self.preload = log, tuple(preload)
        self.child = self.jobs = self.replies = None
        self.ended_in_a_row = 0  # children that ended while writing, since the last one that answered

    def start_if_needed(self) -> bool:
        """Whether a child runs for the next checkpoint: one is started where none runs, in one line where one has
        ended; False, in one line, where none can start or GIVE_UP_AFTER children in a row ended while writing
        (whatever kills them would cost every checkpoint: the writer's thread writes them instead)."""
        if self.child is not None and self.child.poll() is None:
            return True
        if self.child is not None:
            how = ending(self.child.returncode)
            self.close()
            if self.ended_in_a_row >= GIVE_UP_AFTER:
                self.log(f'WARNING: {self.ended_in_a_row} checkpoint writer processes in a row ended while writing '
                         f'(the last: {how}); the writer\'s thread writes the checkpoints from now on')
                return False
            self.log(f'the checkpoint writer process had ended ({how}): starting another')
        try:
            self.start()
        except OSError as e:
            self.log(f'WARNING: the checkpoint writer process could not start ({type(e).__name__}: {e}); the '
                     f'writer\'s thread writes the checkpoints')
            return False
        return True

    def start(self):
        jobs_read, jobs_write = os.pipe()
        replies_read, replies_write = os.pipe()
        path = os.pathsep.join(entry for entry in sys.path if entry)  # the clone's modules, which the models pickle
        try:
            self.child = subprocess.Popen(
                [sys.executable, '-m', __name__, str(jobs_read), str(replies_write), str(os.getpid()), *self.preload],
                pass_fds=(jobs_read, replies_write), env={**os.environ, 'PYTHONPATH': path})
        except OSError:
            os.close(jobs_write)
            os.close(replies_read)
            raise
        finally:
            os.close(jobs_read)
            os.close(replies_write)
        self.jobs, self.replies = Connection(jobs_write, readable=False), Connection(replies_read, writable=False)

    def write(self, copy: QueuedCheckpoint, path: Path):
        """save_atomic(copy(), path, keep_previous=True) in the child: the host copies go over as their buffers' bytes.
        Raises the child's error, or WriterProcessEnded."""
        buffers, layout = buffers_of(copy.landed_copies())
        try:
            self.jobs.send((copy, str(path), layout, [(len(data), dtype) for data, dtype in buffers]))
            for data, _ in buffers:
                self.jobs.send_bytes(data)
            buffers = copy.copies = None  # the page-locked buffers go back to torch's cache
            error = self.replies.recv()
        except (EOFError, OSError) as e:
            self.ended_in_a_row += 1
            raise WriterProcessEnded(f'the checkpoint writer process ended ({ending(self.ended())})') from e
        self.ended_in_a_row = 0
        if error is not None:
            raise error

    def ended(self):
        try:
            return self.child.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            return None

    def close(self):
        """End the child: it ends at the message STOP, once it has written what it was given."""
        try:
            if self.jobs is not None:
                self.jobs.send(STOP)
        except OSError:  # the child has ended
            pass
        for end in (self.jobs, self.replies):
            if end is not None:
                end.close()
        self.jobs = self.replies = None
        if self.child is not None and self.ended() is None:
            self.child.kill()
            self.child.wait()


def ending(returncode) -> str:
    if returncode is None:
        return 'not answering'
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:  # the realtime signals between SIGRTMIN and SIGRTMAX have no names
            return f'signal {-returncode}'
    return f'exit code {returncode}'


def buffers_of(copies: list) -> tuple:
    """([(bytes of each buffer the copies view, its dtype)], [(buffer index, offset, shape, stride) of each copy]):
    QueuedHostCopy's copies are views of one buffer a dtype, or tensors of their own."""
    index, buffers, layout = {}, [], []
    for copy in copies:
        storage = copy.untyped_storage()
        key = storage.data_ptr(), copy.dtype
        if key not in index:
            index[key] = len(buffers)
            data = torch.empty(0, dtype=torch.uint8).set_(storage).numpy() if storage.nbytes() else b''
            buffers.append((memoryview(data).cast('B'), copy.dtype))
        layout.append((index[key], copy.storage_offset(), tuple(copy.shape), copy.stride()))
    return buffers, layout


def tensors_from(buffers: list, layout: list) -> list:
    """buffers_of()'s copies again, from their buffers' bytes (bytearrays: writable, which torch.frombuffer wants)."""
    flat = [torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype) for data, dtype in buffers]
    return [flat[i].as_strided(shape, stride, offset) for i, offset, shape, stride in layout]


def serve(jobs: Connection, replies: Connection):
    """The child: each job written as the writer's thread would, its error (or None) sent back, until STOP (or the
    pipe's end: its parent gone, with every process that inherited the pipe)."""
    while True:
        try:
            job = jobs.recv()
        except EOFError:
            return
        if job == STOP:
            return
        copy, path, layout, sizes = job
        buffers = []
        for size, dtype in sizes:
            data = bytearray(size)
            if size:
                jobs.recv_bytes_into(data)
            buffers.append((data, dtype))
        copy.copies = tensors_from(buffers, layout)
        try:
            save_atomic(copy(), Path(path), keep_previous=True)
            replies.send(None)
        except Exception as e:  # disk full, permissions: the parent says so in one line and trains on
            replies.send(e if picklable(e) else RuntimeError(f'{type(e).__name__}: {e}'))


def picklable(error: Exception) -> bool:
    try:
        pickle.loads(pickle.dumps(error))
        return True
    except Exception:
        return False


def die_with(parent: int):
    """SIGKILL when the thread that started this process ends; gone already if it ended before this line."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


def main():
    jobs_fd, replies_fd, parent = map(int, sys.argv[1:4])
    die_with(parent)
    for signum in shutdown.HANDLED:  # Ctrl-C reaches the whole group, Slurm's SIGTERM every process of the job:
        signal.signal(signum, signal.SIG_IGN)  # the rank decides (shutdown.py), and this ends with it or at STOP
    torch.set_num_threads(1)  # the loader's workers have the other cores
    for module in sys.argv[4:]:
        importlib.import_module(module)
    with Connection(jobs_fd, writable=False) as jobs, Connection(replies_fd, readable=False) as replies:
        serve(jobs, replies)


if __name__ == '__main__':
    main()
