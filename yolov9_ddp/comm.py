"""Process-group life cycle and rank helpers that also work in a single process.

In the spirit of detectron2's utils/comm.py: get_rank() is 0 and barrier() does nothing when no
process group exists, so the training loop is written once for one process and for many.
Ranks come from torchrun's environment: RANK is global (across nodes), LOCAL_RANK picks the GPU.
"""
import contextlib
import datetime
import os
import pickle
import time
import warnings

import torch
import torch.distributed as dist

from yolov9_ddp import environment

DEFAULT_TIMEOUT_S = 3 * 60 * 60  # generous: a first epoch that builds caches may keep ranks apart for long
DECISION_KEY = 'rank0-decision'  # rank0_decides() in the launch store
DECISION_READ_KEY = 'rank0-decision-read'  # how many other ranks have read it
FAILED_DECISION_WAIT_S = 10  # rank 0 failed: how long it waits for the others to read so, at most
_LAUNCH = {}  # the launch store, once made (launch_store)


class Unanimous(Exception):
    """An error every rank raises the same way (same flags, same files): reported once, by rank 0."""


class LaunchError(Exception):
    """The launch configuration cannot work (devices, world size, arguments); message says why."""


class PeerFailed(Exception):
    """Another rank failed in a step all ranks take together; that rank reports the cause."""


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def get_local_rank() -> int:
    return int(os.environ.get('LOCAL_RANK', 0))


def get_local_world_size() -> int:
    return int(os.environ.get('LOCAL_WORLD_SIZE', 1))


def is_primary() -> bool:
    return get_rank() == 0


def launched_rank() -> int:
    """RANK as set by the launcher: still right after the process group is gone."""
    return int(os.environ.get('RANK', 0))


def launched_world_size() -> int:
    """WORLD_SIZE as set by the launcher, before any process group exists."""
    return int(os.environ.get('WORLD_SIZE', 1))


def barrier():
    if is_distributed():
        dist.barrier()


def broadcast_object(obj, src=0):
    """obj from rank src on every rank (the object itself in a single process)."""
    if not is_distributed():
        return obj
    holder = [obj]
    with warnings.catch_warnings():
        # torch 2.4 and 2.5 unpickle the tensors of a received object with their own torch.load(io.BytesIO(b))
        # (torch/storage.py), which warns about weights_only: a warning about torch's code, on every rank but src
        warnings.filterwarnings('ignore', 'You are using `torch.load` with `weights_only=False`', FutureWarning)
        dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(obj) -> list:
    if not is_distributed():
        return [obj]
    gathered = [None] * get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def average_tensors_(tensors):
    """Replace each tensor by its mean over all ranks, in one all_reduce; the result is the same bits everywhere."""
    tensors = list(tensors)
    if not is_distributed() or not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # gloo has no ReduceOp.AVG
    flat /= get_world_size()
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def max_over_ranks(value: int) -> int:
    """The largest of every rank's value, on every rank."""
    return maxima_over_ranks([value])[0]


def maxima_over_ranks(values: list) -> list:
    """For each position of values, the largest of every rank's, on every rank: one all_reduce."""
    if not is_distributed():
        return list(values)
    tensor = torch.tensor(values, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank when flag is True on at least one (used to stop all ranks together)."""
    return bool(max_over_ranks(int(flag)))


def raise_if_any_failed(error: BaseException = None):
    """After a step every rank takes: re-raise this rank's error, or stop because another rank failed.

    Every rank must call it, failed or not, so that none is left waiting in a later collective.
    """
    if any_rank(error is not None):
        if error is not None:
            raise error
        raise PeerFailed('stopping: another rank failed (its error message says why)')


def run_staged(build):
    """build() on global rank 0, then on each node's local rank 0, then on the other ranks; its result.

    After each stage all ranks learn whether anyone failed, so a failure stops every rank at once,
    and later stages do not repeat work (a download, a cache) that just failed.
    """
    rank, local_rank = get_rank(), get_local_rank()
    stage = 0 if rank == 0 else 1 if local_rank == 0 else 2
    result, error = None, None
    for turn in range(3):
        if turn == stage:
            try:
                result = build()
            except Exception as e:  # raised below, on every rank together
                error = e
        raise_if_any_failed(error)
    return result


def backend_for(device: torch.device) -> str:
    return 'nccl' if device.type == 'cuda' else 'gloo'


def collective_device() -> torch.device:
    return torch.device('cuda', torch.cuda.current_device()) if dist.get_backend() == 'nccl' else torch.device('cpu')


def select_device(device_arg: str) -> torch.device:
    """The device of this process: --device as in upstream ('', 'cpu', '0', '0,1'), LOCAL_RANK picks the GPU.

    Without --device and without a usable GPU, one process trains on the CPU as upstream does (the banner says
    why); several processes are refused, rather than silently training N gloo processes on the CPU."""
    choice = str(device_arg).strip().lower().replace('cuda:', '').replace('none', '')
    local_rank, local_world, world = get_local_rank(), get_local_world_size(), launched_world_size()
    if choice == 'cpu':
        return torch.device('cpu')
    if choice:
        # like upstream: the ids name the visible GPUs; must be set before CUDA initialises
        os.environ['CUDA_VISIBLE_DEVICES'] = choice
    if not torch.cuda.is_available():
        why = environment.cuda_unusable_reason() or 'torch.cuda.is_available() is False'
        unusable = f'torch {torch.__version__} cannot use CUDA here ({why})'
        if choice:
            raise LaunchError(f'--device {device_arg} asks for CUDA, but {unusable}: use --device cpu, or install '
                              f'a torch build that your NVIDIA driver supports')
        if world > 1:
            raise LaunchError(f'{world} processes without --device cpu, but {unusable}: add --device cpu to train '
                              f'{world} CPU processes with gloo, or install a torch build that your NVIDIA driver '
                              f'supports')
        return torch.device('cpu')
    count = torch.cuda.device_count()
    if local_world > count:
        raise LaunchError(f'{local_world} processes on this node but only {count} CUDA device(s) visible; '
                          f'use --nproc_per_node {count} or fewer')
    return torch.device('cuda', local_rank)


def print_banner(device: torch.device, device_arg: str):
    """Rank 0: one line with torch, its CUDA, the devices, the backend and the world size."""
    if launched_rank() == 0:
        print(environment.banner(device, device_arg, launched_world_size(), backend_for(device)), flush=True)


def launch_store(timeout: datetime.timedelta) -> dist.Store:
    """The launch's key-value store, made once per process: rank0_decides() sends through it before the process
    group exists, and the group meets in it (torchrun's agent store; rank 0's TCPStore under a plain env:// launch).

    Its keys are private to this restart attempt. torchrun keeps one store across the restarts of its workers
    (--max-restarts). With torch 2.14 the restarted workers find the previous attempt's keys in it and connect to
    the addresses of dead processes: gloo fails with "connectFullMesh failed ... Connection refused" and the job
    never resumes. Prefixing the keys with the attempt number gives each attempt a clean rendezvous.
    """
    if 'store' not in _LAUNCH:
        store, _, _ = next(dist.rendezvous('env://', launched_rank(), launched_world_size(), timeout=timeout))
        attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)
        _LAUNCH['store'] = dist.PrefixStore(f'yolov9-ddp/attempt_{attempt}', store)
    return _LAUNCH['store']


def rank0_decides(decide, timeout_s: float):
    """decide() on global rank 0, and its result (not None) on every rank, before the process group exists: what
    each rank's checks and device depend on (a resumed run's options). An error of decide() is raised on rank 0;
    the other ranks stop with PeerFailed."""
    if launched_world_size() <= 1:
        return decide()
    store = launch_store(datetime.timedelta(seconds=timeout_s))
    if launched_rank() == 0:
        decision = None
        try:
            decision = decide()
        finally:  # None tells the other ranks that rank 0 failed, so that they do not wait for it
            store.set(DECISION_KEY, pickle.dumps(decision))
            if decision is None:
                wait_for_readers(store, launched_world_size() - 1, FAILED_DECISION_WAIT_S)
        return decision
    decision = pickle.loads(store.get(DECISION_KEY))
    store.add(DECISION_READ_KEY, 1)
    if decision is None:
        raise PeerFailed('stopping: rank 0 failed before training (its error message says why)')
    return decision


def wait_for_readers(store: dist.Store, readers: int, timeout_s: float):
    """Until that many other ranks have read rank 0's decision, timeout_s at most. A rank 0 that failed stops only
    then: once it has exited, torchrun SIGTERMs the others, and a rank still starting up would be killed before it
    stops by itself (recording why for torchrun's summary); under a plain env:// launch the store is rank 0's and
    would be gone before they read it."""
    deadline = time.monotonic() + timeout_s
    while store.add(DECISION_READ_KEY, 0) < readers and time.monotonic() < deadline:
        time.sleep(0.05)


@contextlib.contextmanager
def process_group(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Initialise the default process group under a launcher (NCCL on CUDA, gloo on CPU); always destroy it.

    Without a launcher (WORLD_SIZE unset or 1) nothing is initialised and the helpers above act as one process.
    """
    if launched_world_size() <= 1:
        yield
        return
    if device.type == 'cuda':
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend_for(device), timeout=timeout,
                            device_id=device if device.type == 'cuda' else None,
                            store=launch_store(timeout), rank=launched_rank(), world_size=launched_world_size())
    try:
        yield
    finally:
        dist.destroy_process_group()
