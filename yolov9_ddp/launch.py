"""`--device 0,1,2,3` outside torchrun: the entry point starts the DDP job itself, with torch.distributed.run's
launcher in this process (as ultralytics does for a device list), one worker per listed device, each running this
same command; `--device cpu,cpu` gives two CPU workers with gloo. The job is a torchrun job: --max-restarts, stops on
signals, one line per failure, the exit status. Under a launcher, a list that names another number of devices than
the node's processes is refused in one line.
"""
import os
import signal
import sys

from yolov9_ddp import comm

STARTED = 'YOLOV9_DDP_STARTED_BY_DEVICE_LIST'  # in the environment of the workers run() starts


def under_launcher() -> bool:
    """Whether torchrun, Slurm's scripts or the legacy launcher started this process (they set WORLD_SIZE)."""
    return 'WORLD_SIZE' in os.environ


def check(opt):
    """The device list against how this process was started, before anything is built (comm.LaunchError)."""
    listed = comm.listed_devices(opt.device)
    if under_launcher():
        local = comm.get_local_world_size()
        if len(listed) > 1 and len(listed) != local:
            raise comm.LaunchError(f'--device {opt.device} names {len(listed)} devices, but the launcher started '
                                   f'{local} process(es) on this node: give it --nproc_per_node {len(listed)}, or '
                                   f'name {local} devices')
        if opt.max_restarts and not os.environ.get(STARTED):
            raise comm.LaunchError('--max-restarts is for a --device list without torchrun; give torchrun its own '
                                   '--max-restarts')
    elif opt.max_restarts and len(listed) < 2:
        raise comm.LaunchError('--max-restarts restarts the job a --device list starts: name its devices, e.g. '
                               '--device 0,1')
    if 'cpu' in listed and set(listed) != {'cpu'}:
        raise comm.LaunchError(f'--device {opt.device} mixes the CPU and GPUs: name GPUs only, or cpu once per process')


def wanted(opt) -> bool:
    """Whether this process starts the job: a list of several devices, and no launcher around it."""
    return not under_launcher() and len(comm.listed_devices(opt.device)) > 1


def run(script: str, argv: list, opt) -> int:
    """The job of len(devices) workers, each `python script argv`, on this node; its exit status."""
    listed = comm.listed_devices(opt.device)
    if listed[0] != 'cpu':
        check_gpus(listed)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as torchrun
    args = get_args_parser().parse_args(['--standalone', '--nproc-per-node', str(len(listed)), '--max-restarts',
                                         str(opt.max_restarts), script, *argv])
    os.environ[STARTED] = '1'
    try:
        torchrun(args)
    except ChildFailedError as e:  # each worker has said why, in one line, but one killed before it could
        for rank, failure in sorted(e.failures.items()):
            if not os.path.isfile(failure.error_file):
                print(f'{os.path.basename(script)}: error [rank {rank}]: {describe(failure.exitcode)}',
                      file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def check_gpus(listed: list):
    """Every listed GPU exists here, said before any worker starts."""
    import torch
    from yolov9_ddp.environment import cuda_unusable_reason
    count = torch.cuda.device_count()
    if not count:
        raise comm.LaunchError(f'--device {",".join(listed)} asks for GPUs, but torch cannot use CUDA here '
                               f'({cuda_unusable_reason() or "no CUDA device is visible"}): use --device cpu')
    missing = [d for d in listed if not d.isdigit() or int(d) >= count]
    if missing:
        raise comm.LaunchError(f'--device {",".join(listed)} names GPU {missing[0]}, but this machine has {count} '
                               f'CUDA device(s), 0 to {count - 1}: name the GPUs it has')


def describe(exitcode: int) -> str:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in set(signal.Signals) else f'signal {-exitcode}'
        return f'the process was killed by {name} (the out-of-memory killer, if no one else sent it)'
    return f'the process exited with status {exitcode}'
