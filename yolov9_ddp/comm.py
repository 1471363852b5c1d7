"""Process-group life cycle and rank helpers that also work in one process (get_rank() is 0 and barrier() does
nothing without a group, as detectron2's utils/comm.py), so the loop is written once for one process and many."""
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
    if not is_distributed():
        return value
    tensor = torch.tensor([value], device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def raise_if_any_failed(error: BaseException = None):
    """Every rank, failed or not, after a step all take: this rank's error, or PeerFailed where another failed, so
    that none is left waiting in a later collective."""
    if max_over_ranks(int(error is not None)):
        if error is not None:
            raise error
        raise PeerFailed('stopping: another rank failed (its error message says why)')


def run_staged(build):
    """build() on global rank 0, then on each node's local rank 0, then on the other ranks (a download, a cache is
    made once); after each stage a failure stops every rank at once."""
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


def listed_devices(device_arg) -> list:
    """The devices --device names: '0,1' -> ['0', '1'], 'cpu,cpu' -> ['cpu', 'cpu'], '' -> []."""
    choice = str(device_arg or '').strip().lower().replace('cuda:', '')
    return [item.strip() for item in choice.split(',') if item.strip()]


def select_device(device_arg: str) -> torch.device:
    """The device of this process: --device as upstream's ('', 'cpu', '0', '0,1'), LOCAL_RANK picking the GPU. No
    usable GPU: one process trains on the CPU as upstream's does; several are refused, not silently put there."""
    choice = str(device_arg).strip().lower().replace('cuda:', '').replace('none', '')
    local_rank, local_world, world = get_local_rank(), get_local_world_size(), launched_world_size()
    if set(listed_devices(choice)) == {'cpu'}:  # cpu, or cpu,cpu: a CPU process each (launch.py)
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
    """The launch's key-value store, made once per process: rank0_decides() sends through it, and the group meets in
    it. Its keys are this restart attempt's: torchrun keeps one store across restarts, and gloo would otherwise
    connect to the dead processes of the previous attempt ("connectFullMesh failed ... Connection refused")."""
    if 'store' not in _LAUNCH:
        store, _, _ = next(dist.rendezvous('env://', launched_rank(), launched_world_size(), timeout=timeout))
        attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)
        _LAUNCH['store'] = dist.PrefixStore(f'yolov9-ddp/attempt_{attempt}', store)
    return _LAUNCH['store']


def rank0_decides(decide, timeout_s: float):
    """decide() on global rank 0, its result (not None) on every rank, before the process group exists (a resumed
    run's options decide each rank's checks and device); where it raises, the other ranks stop with PeerFailed."""
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
    """Until that many other ranks have read rank 0's decision, timeout_s at most: a failed rank 0 that exited
    first would have torchrun kill them before they stop by themselves, and take its store along."""
    deadline = time.monotonic() + timeout_s
    while store.add(DECISION_READ_KEY, 0) < readers and time.monotonic() < deadline:
        time.sleep(0.05)


@contextlib.contextmanager
def process_group(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S):
    """The default process group under a launcher (NCCL on CUDA, gloo on CPU), always destroyed; without one
    (WORLD_SIZE unset or 1) none, and the helpers above act as one process."""
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
