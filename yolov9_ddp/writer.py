"""The checkpoint writer process: a child of rank 0 that completes and writes each checkpoint the writer thread hands
it (checkpoints.Checkpoints), so that pickling and writing the model objects holds another interpreter's lock, not
the training thread's (a thread cost training several times as much: docs/benchmarks.md).

Forked as the run sets up, before the model, the data and CUDA exist, it needs no start-up. It gets a checkpoint's
pickle and its host copies' bytes over a pipe and answers with the write's error or None. It dies with its rank
(PR_SET_PDEATHSIG), leaving no writer to finish a file a restart does not expect, and ends at a STOP message (the
loader's workers, forked later, hold the pipe's ends too). Where none can start, or GIVE_UP_AFTER in a row end while
writing, the writer thread writes, after one line.
"""
import atexit
import ctypes
import multiprocessing
import os
import pickle
import signal
from pathlib import Path

import torch

from yolov9_ddp import failures, shutdown

STOP_WAIT_S = 30
STOP = 'stop'  # the last message a child gets
GIVE_UP_AFTER = 2  # children in a row that ended while writing
NAME = b'yolov9-writer'  # what ps and top show of the child (its command line is its parent's)
PR_SET_NAME = 15  # prctl(2)


class WriterProcessEnded(Exception):
    """The child ended before it answered: the checkpoint it was given is not written."""


class WriterProcess:
    """The parent's end: start_if_needed() on the training thread, write() in the writer thread, close() at the end."""

    def __init__(self, log):
        self.log = log
        self.child = self.jobs = self.replies = None
        self.ended_in_a_row = 0  # children that ended while writing, since the last one that answered

    def start_if_needed(self) -> bool:
        """Whether a child runs for the next checkpoint: one is started where none runs, in one line where one has
        ended; False, in one line, where none can start or GIVE_UP_AFTER children in a row ended while writing."""
        if self.child is not None and self.child.is_alive():
            return True
        if self.child is not None:
            how = ending(self.child.exitcode)
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
        context = multiprocessing.get_context('fork')
        jobs, self.jobs = context.Pipe(duplex=False)
        self.replies, replies = context.Pipe(duplex=False)
        self.child = context.Process(target=serve, args=(jobs, replies, os.getpid()), name='checkpoint-writer')
        try:
            self.child.start()
        finally:
            jobs.close()
            replies.close()
        atexit.register(self.close)  # before multiprocessing's own, which would join a child that waits for a job

    def write(self, copy, path: Path, save):
        """save(copy(), path, keep_previous=True) in the child: the host copies go over as their buffers' bytes.
        Raises the child's error, or WriterProcessEnded."""
        buffers, layout = buffers_of(copy.landed_copies())
        try:
            self.jobs.send((copy, str(path), save, layout, [(len(data), dtype) for data, dtype in buffers]))
            for data, _ in buffers:
                self.jobs.send_bytes(data)
            buffers = copy.copies = None  # the page-locked buffers go back to torch's cache
            error = self.replies.recv()
        except (EOFError, OSError) as e:
            self.ended_in_a_row += 1
            self.child.join(STOP_WAIT_S)
            raise WriterProcessEnded(f'the checkpoint writer process ended ({ending(self.child.exitcode)})') from e
        self.ended_in_a_row = 0
        if error is not None:
            raise error

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
        if self.child is not None:
            self.child.join(STOP_WAIT_S)
            if self.child.exitcode is None:
                self.child.kill()
                self.child.join()


def ending(exitcode) -> str:
    if exitcode is None:
        return 'not answering'
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:  # the realtime signals between SIGRTMIN and SIGRTMAX have no names
            return f'signal {-exitcode}'
    return f'exit code {exitcode}'


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


def serve(jobs, replies, parent: int):
    """The child: each job written, its error (or None) sent back, until STOP (or the pipe's end)."""
    failures.die_with_parent(parent)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, NAME)
    for signum in shutdown.HANDLED:  # Ctrl-C reaches the whole group, Slurm's SIGTERM every process of the job:
        signal.signal(signum, signal.SIG_IGN)  # the rank decides (shutdown.py), and this ends with it or at STOP
    torch.set_num_threads(1)  # the loader's workers have the other cores
    while True:
        try:
            job = jobs.recv()
        except EOFError:
            return
        if job == STOP:
            return
        copy, path, save, layout, sizes = job
        buffers = []
        for size, dtype in sizes:
            data = bytearray(size)
            if size:
                jobs.recv_bytes_into(data)
            buffers.append((data, dtype))
        copy.copies = tensors_from(buffers, layout)
        try:
            save(copy(), Path(path), keep_previous=True)
            replies.send(None)
        except Exception as e:  # disk full, permissions: the parent says so in one line and trains on
            replies.send(e if picklable(e) else RuntimeError(f'{type(e).__name__}: {e}'))


def picklable(error: Exception) -> bool:
    try:
        pickle.loads(pickle.dumps(error))
        return True
    except Exception:
        return False
