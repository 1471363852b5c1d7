"""Checkpoints: written whole or not at all, and read back with a clear error when they are not usable.

A checkpoint is written to a temporary file beside its destination, flushed to disk, then moved
into place with os.replace (as timm's CheckpointSaver): a crash at any moment leaves either the
previous file or the new one, never a truncated one. The format is upstream's (the model objects
are pickled, so upstream's val_dual.py, detect_dual.py and attempt_load() read our files), plus
what an exact resume needs: the grad scaler and the kit's format version.

Periodic checkpoints (--checkpoint-steps, --checkpoint-minutes) are written off the training thread, as
torchtitan's asynchronous checkpoints: rank 0 queues a host copy of the state between two steps (QueuedHostCopy)
and a CheckpointWriter completes and writes it in a background thread, one write at a time, while training goes on.
"""
import io
import itertools
import os
import pickle
import shutil
import sys
import threading
import time
import zipfile
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from yolov9_ddp import pickling
from yolov9_ddp.comm import Unanimous

FORMAT = 'yolov9-ddp/1'
RESUME_KEYS = ('epoch', 'model', 'ema', 'updates', 'optimizer', 'opt')
COPY_CHUNK = 16 * 2 ** 20  # bytes
MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
# The interpreter's lock changes hands this often while a periodic checkpoint is written beside training (Python's
# default: 5 ms). The training thread lets go of it at every torch call; with the writer's thread waiting, it
# then waits up to a whole interval to get it back (the convoy effect, https://bugs.python.org/issue7946).
WRITING_SWITCH_INTERVAL_S = 0.00005


class CheckpointError(Exception):
    """A checkpoint file that cannot be used; the message names the file and the reason."""


class ModelMismatch(CheckpointError, Unanimous):
    """A resume checkpoint of another model: every rank finds it loading the same weights."""


def save_atomic(obj, path: Path, keep_previous=False):
    """Write obj to path in one rename; with keep_previous the file it replaces stays as previous_path(path)."""
    # Through a Python file object, whose writes let go of the GIL: given the file's name, torch's own writer holds
    # it, and a background write cost the training thread 0.43 s a checkpoint instead of 0.28 s (bench/ckpt_cost.py
    # on an H200, bench/results-raw/r3-1gpu-ckpt-cost.json).
    write_atomic(path, lambda f: torch.save(obj, f, pickle_module=pickling), keep_previous)


def copy_atomic(source: Path, path: Path):
    """path becomes a copy of the checkpoint source, in one rename: the epoch's best.pt and epochN.pt are the bytes
    of its last.pt, copied, not pickled again (pickling the model objects is most of what a save costs)."""
    def copy(f):
        with open(source, 'rb') as src:
            shutil.copyfileobj(src, f, COPY_CHUNK)
    write_atomic(path, copy)


def write_atomic(path: Path, write, keep_previous=False):
    """write(f) into a temporary file beside path, flushed to disk, then moved into place."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, 'wb') as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_path(path))  # a crash right after this leaves the previous one to resume from
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync(path.parent)  # the rename itself is only durable once the folder entry is on disk


def temporary_path(path: Path) -> Path:
    """Where a writer of path puts its bytes before the rename: hidden, per process (remove_stale_temporaries)."""
    return path.with_name(f'.{path.name}.{os.getpid()}.tmp')


def previous_path(path: Path) -> Path:
    """Where save_atomic(keep_previous=True) keeps the checkpoint it replaced: last.pt -> last.previous.pt."""
    return path.with_name(f'{path.stem}.previous{path.suffix}')


def fsync(path: Path):
    """Flush a file's bytes, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(folder: Path):
    """Temporary files of writers that were killed before their os.replace."""
    for tmp in Path(folder).glob('.*.tmp'):
        tmp.unlink(missing_ok=True)


class QueuedHostCopy:
    """A copy of a checkpoint whose tensors are detached copies in host memory, sharing nothing with obj: the training
    thread goes on changing its own (the next optimizer step, the EMA) while a background thread writes this one. In
    two halves, so that the training thread never waits for the GPU: made on the training thread between two steps,
    result() wherever the copy is needed (CheckpointWriter's thread).

    obj is pickled in memory as torch.save would write it (modules, optimizer state, nested containers), with every
    tensor set aside and its copy to the host queued on the GPU's stream (queue_host_copies), behind the step that
    made it and ahead of any later step that changes it: a model on a GPU never has a second copy there, as a
    deepcopy would make before moving it, and a tensor held in two places is copied once, as torch.save keeps it.
    result() waits for those copies (an event recorded behind them) and rebuilds obj around them, each tensor with
    its own storage again, so that neither the wait nor the rebuild's Python work falls on the training thread
    (0.74-0.87 s of its time a checkpoint when both did, on an H200 with CUDA graphs: bench/RESULTS.md)."""

    def __init__(self, obj):
        buffer = io.BytesIO()
        pickler = TensorsAside(buffer)
        pickler.dump(obj)
        self.pickled = buffer.getvalue()
        self.kinds = [(isinstance(t, nn.Parameter), t.requires_grad) for t in pickler.tensors]
        self.copies, self.landed = queue_host_copies(pickler.tensors)

    def result(self):
        """The copy, once: its page-locked buffers go back to torch's cache as it returns, before the write."""
        copies, self.copies = self.landed_copies(), None
        tensors = [own_tensor(copy, parameter, requires_grad)
                   for copy, (parameter, requires_grad) in zip(copies, self.kinds)]
        return TensorsBack(io.BytesIO(self.pickled), tensors).load()

    def landed_copies(self) -> list:
        """The host copies of the tensors set aside, once every queued copy has landed (views of shared buffers)."""
        if self.landed is not None:
            self.landed.synchronize()
            self.landed = None
        return self.copies

    def __getstate__(self):
        """What a writer process gets (yolov9_ddp/checkpoint_process.py): all but the host copies, which follow as
        bytes, and the event."""
        return {**self.__dict__, 'copies': None, 'landed': None}


class QueuedCheckpoint(QueuedHostCopy):
    """A trainer's checkpoint as a QueuedHostCopy, which calling completes in upstream's format (its scripts read
    ours), wherever that runs (CheckpointWriter's thread or process, or at once for an epoch's save): the grad
    scaler's numbers (scaler_numbers), the models in the default memory format, which upstream's
    fuse_conv_and_bn() (a .view) requires."""

    def __call__(self) -> dict:
        ckpt = self.result()
        ckpt['scaler'] = scaler_numbers(ckpt['scaler'])
        for key in ('model', 'ema'):
            ckpt[key].to(memory_format=torch.contiguous_format)
        return ckpt


class TensorsAside(pickling.Pickler):
    """Pickles all but the tensors, which it sets aside in self.tensors, each once (a tensor held twice is pickled
    once, then referred to). reducer_override rather than persistent_id: the pickler asks it about every object but
    the builtin ones, a third of the calls and of the time (97,065 calls and 0.051 s against 17,277 and 0.034 s for
    gelan-c and its EMA on a CPU); the empty OrderedDicts it leaves to pickling.Pickler."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = []

    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return super().reducer_override(obj)
        self.tensors.append(obj)
        return set_aside, (len(self.tensors) - 1,)


def set_aside(index: int):
    """The stand-in that TensorsAside pickles for its index-th tensor, which TensorsBack puts back."""
    raise pickle.UnpicklingError('a checkpoint pickled with its tensors set aside is read back by TensorsBack only')


class TensorsBack(pickle.Unpickler):
    """Unpickles what TensorsAside pickled, with the given tensors in place of those it set aside."""

    def __init__(self, file, tensors: list):
        super().__init__(file)
        self.tensors = tensors

    def find_class(self, module, name):
        if (module, name) == (__name__, set_aside.__name__):
            return self.tensors.__getitem__
        return super().find_class(module, name)


def queue_host_copies(tensors: list) -> tuple:
    """(detached copies of tensors in host memory, each in its tensor's memory format; the event recorded behind
    those from a GPU, or None). A checkpoint holds thousands of tensors (4,453 for yolov9-s and its EMA), and a copy
    each cost the training thread a torch call each: the tensors of one device and dtype are copied into views of
    one buffer (page-locked for a GPU's, so that the copies are only queued) by a single call. A tensor that does not
    cover its memory densely is copied alone. The views share their buffer until own_tensor()."""
    copies, groups = [None] * len(tensors), defaultdict(list)
    for i, tensor in enumerate(tensors):
        if dense(tensor):
            groups[tensor.device, tensor.dtype].append(i)
        else:
            copies[i] = tensor.detach().to('cpu', copy=True, non_blocking=True)
    for (device, dtype), indices in groups.items():
        sizes = [tensors[i].numel() for i in indices]
        buffer = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == 'cuda')
        for i, start in zip(indices, itertools.accumulate(sizes, initial=0)):
            copies[i] = buffer[start:].as_strided(tensors[i].shape, tensors[i].stride())
        with torch.no_grad():
            torch._foreach_copy_([copies[i] for i in indices], [tensors[i] for i in indices], non_blocking=True)
    gpus = {tensor.device for tensor in tensors if tensor.is_cuda}  # one: a rank's state lives on its GPU
    if not gpus:
        return copies, None
    landed = torch.cuda.Event()
    landed.record(torch.cuda.current_stream(gpus.pop()))
    return copies, landed


def scaler_state(scaler) -> dict:
    """GradScaler.state_dict(), its scale and growth tracker left as copies on their device, taken in the stream's
    order: state_dict() reads each with .item(), so the training thread would wait for the GPU's queue to drain at
    every checkpoint, and the GPU then idle while the thread pickles and queues the rest. The checkpoint's host copy
    takes the two with its other tensors; scaler_numbers() makes them state_dict()'s numbers again."""
    scale = scaler._get_scale_async() if scaler.is_enabled() else None
    if scale is None:  # disabled, or before the first scaled step: state_dict() reads nothing from a device
        return scaler.state_dict()
    return {'scale': scale.detach().clone(), 'growth_factor': scaler.get_growth_factor(),
            'backoff_factor': scaler.get_backoff_factor(), 'growth_interval': scaler.get_growth_interval(),
            '_growth_tracker': scaler._growth_tracker.detach().clone()}


def scaler_numbers(state: dict) -> dict:
    """scaler_state()'s host copy as GradScaler.state_dict() gives it: numbers only (upstream's files hold those)."""
    return {key: value.item() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def dense(tensor: torch.Tensor) -> bool:
    """Whether tensor's elements fill its memory without gaps, in the order of one of torch's memory formats."""
    return tensor.layout == torch.strided and any(tensor.is_contiguous(memory_format=memory_format)
                                                  for memory_format in MEMORY_FORMATS)


def own_tensor(copy: torch.Tensor, parameter: bool, requires_grad: bool) -> torch.Tensor:
    """A host copy in its own storage (torch.save writes a storage whole), in the same memory format; a Parameter
    stays one (a pickled module's are)."""
    copy = copy.clone()
    if parameter:
        return nn.Parameter(copy, requires_grad=requires_grad)
    return copy.requires_grad_(requires_grad)


class CheckpointWriter:
    """Rank 0's writer of periodic checkpoints: save_atomic(keep_previous=True) in a background thread, one write at
    a time, so that a slow disk never stalls training (and with it every rank, at the next collective).

    A write still running when the next is due makes that one skipped, with one line: the next due one comes soon
    enough, and a queue behind a slow disk would only grow. A write that fails costs that checkpoint only.

    The thread is no daemon: a normal exit (sys.exit on a failure too) joins it, so a write under way completes
    rather than being cut off during the interpreter's teardown; a SIGKILL mid-write leaves the previous files, as
    any crash does (save_atomic). Any synchronous save into the same folder must wait() first: in one process both
    writers of a file would use the same temporary file (temporary_path)."""

    def __init__(self, log, process=None):
        self.log = log  # one line per skipped or failed write
        self.process = process  # a checkpoint_process.WriterProcess, which writes each QueuedCheckpoint (a lever)
        self.thread = None
        self.started = None  # time.monotonic() of the running write's start

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start_process(self):
        """The writer process, if any, started now, ahead of the first checkpoint (on the training thread); where it
        cannot be (WriterProcess.start_if_needed says why), the thread writes from now on."""
        if self.process is not None and not self.process.start_if_needed():
            self.process = None

    def submit(self, queue, path: Path, name: str, then=None) -> bool:
        """Write a checkpoint to path, unless the previous write still runs: then skip it with one line, and queue()
        is not called; name says which checkpoint this is ('checkpoint at step 1200'). queue(): the training thread's
        half of the checkpoint, called here (a QueuedHostCopy, which nothing else changes); it returns the function
        that completes the checkpoint in the writer's thread. then(): run in the writer's thread once the file is in
        place (the run's record of its checkpoints). With a writer process, queue() returns a QueuedCheckpoint, which
        is completed and written there; the writer's thread then only hands it over."""
        if self.running:
            self.log(f'{name} skipped: the previous write ({time.monotonic() - self.started:.1f} s so far) is still '
                     f'running')
            return False
        self.start_process()  # again where it has ended; on the training thread, which the process's life follows
        make = queue()
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self.write, args=(make, Path(path), name, then),
                                       name='checkpoint-writer')
        self.thread.start()
        return True

    def write(self, make, path: Path, name: str, then):
        try:
            if self.process is not None:
                self.process.write(make, path)
            else:
                with switch_interval(WRITING_SWITCH_INTERVAL_S):
                    save_atomic(make(), path, keep_previous=True)
            if then is not None:
                then()
        except Exception as e:  # disk full, permissions: no partial file, and the checkpoints before it are intact
            detail = ' '.join(str(e).split())[:200]  # one line, whatever the error's text
            self.log(f'WARNING: {name} could not be written to {path} ({type(e).__name__}: {detail}); '
                     f'training goes on, and a resume takes the checkpoint before it')

    def wait(self):
        """Block until the write under way (if any) has ended: before a synchronous save, and at the end."""
        if self.thread is not None:
            self.thread.join()

    def close(self):
        """The end of training: the last write completes before the run goes on to strip and validate."""
        self.wait()
        if self.process is not None:
            self.process.close()


def load_checkpoint(path: Path, require_resume_state=False) -> dict:
    """torch.load of a run's own checkpoint (a trusted pickle), with the failure modes named."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f'{path}: no such checkpoint')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f'{path} is truncated or corrupt ({type(e).__name__}: {str(e)[:120]})') from e
    if not isinstance(ckpt, dict) or 'model' not in ckpt:
        raise CheckpointError(f'{path} is not a YOLOv9 checkpoint (no model in it)')
    if require_resume_state:
        missing = [k for k in RESUME_KEYS if ckpt.get(k) is None]  # a final checkpoint is stripped of them
        if missing:
            raise CheckpointError(f'{path} cannot be resumed: it lacks {", ".join(missing)} '
                                  f'(a stripped final checkpoint?)')
    return ckpt


def load_for_resume(path: Path, log) -> tuple:
    """(checkpoint, the file it came from): path, or the checkpoint it replaced when path is unusable."""
    try:
        return load_checkpoint(path, require_resume_state=True), path
    except CheckpointError as error:
        previous = previous_path(path)
        if not previous.is_file():
            raise
        log(f'WARNING: {error}; resuming from {previous} instead (one checkpoint earlier)')
        try:
            return load_checkpoint(previous, require_resume_state=True), previous
        except CheckpointError as second:
            raise CheckpointError(f'{error}; and {second}') from second


@contextmanager
def switch_interval(seconds: float):
    """sys.setswitchinterval(seconds) for the block (one writer at a time sets it), then the interval before it."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
