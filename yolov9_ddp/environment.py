"""The Python environment a run finds, checked once at start and described in one banner line: what
requirements.txt's lower bounds cannot enforce (a torch below the oldest CI trains on, no importable OpenCV, GPUs
where CUDA cannot start), each in one line that says what to do."""
import importlib
import os
import re
import sys

import torch

from yolov9_ddp import __version__, failures

# The oldest torch that CI proves (constraints/oldest.txt, the smoke tests); requirements.txt says the same.
TORCH_FLOOR = (2, 4)


def release(version: str) -> tuple:
    """(major, minor) of a version string: '2.4.0+cu121' -> (2, 4), '2.6.0a0+git1234' -> (2, 6)."""
    match = re.match(r'(\d+)\.(\d+)', str(version))
    return (int(match[1]), int(match[2])) if match else (0, 0)


def first_sentence(text: str) -> str:
    """torch's CUDA errors run to several sentences and a URL; the first one says what is wrong."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ''
    return re.split(r'(?<=[a-z0-9)])\. ', line, maxsplit=1)[0].rstrip('.')


def unsupported_reason() -> str:
    """Why this environment cannot run the kit ('' if it can): a torch below the floor, or no usable OpenCV."""
    if release(torch.__version__) < TORCH_FLOOR:
        floor = '.'.join(map(str, TORCH_FLOOR))
        return (f'yolov9-ddp needs torch >= {floor} (found {torch.__version__}): upgrade torch '
                f'(pick the build for your CUDA driver, see docs/clone.md, "Your Python environment")')
    try:
        importlib.import_module('cv2')  # upstream's modules import it at module level
    except ImportError as e:
        return (f'OpenCV does not import ({e}): install one OpenCV package, e.g. pip install {opencv_for_numpy()} '
                f'(opencv-python if you need its windows; never both, they share the cv2 folder)')
    return ''


def opencv_for_numpy() -> str:
    """The OpenCV to suggest: from 4.12 on its wheels require numpy >= 2, so pip would upgrade a numpy 1.x."""
    import numpy
    return 'opencv-python-headless' if release(numpy.__version__) >= (2, 0) else "'opencv-python-headless<4.12'"


def exit_if_unsupported(program: str):
    """Before upstream's modules are imported: one line and exit status 1 instead of a traceback, said by the first
    process of each node, the others exiting once it has (failures.wait_for_the_node_reporter)."""
    reason = unsupported_reason()
    if not reason:
        return
    reporter = int(os.environ.get('LOCAL_RANK', 0)) == 0
    if reporter:
        print(f'{program}: error: {reason}', file=sys.stderr, flush=True)
    failures.record_for_torchrun(f'{program}: {reason}')
    if not reporter:
        failures.wait_for_the_node_reporter()
    sys.exit(1)


def cuda_unusable_reason() -> str:
    """Why torch cannot use a GPU here, in torch's words ('' if it can): torch.cuda.is_available() says only False,
    torch.cuda.init() raises the reason."""
    if torch.version.cuda is None and getattr(torch.version, 'hip', None) is None:
        return 'this torch is a build without CUDA'
    try:
        torch.cuda.init()
    except (RuntimeError, AssertionError) as e:
        return first_sentence(e)
    if torch.cuda.device_count() == 0:
        return f'no CUDA device is visible (CUDA_VISIBLE_DEVICES={os.environ.get("CUDA_VISIBLE_DEVICES")!r})'
    return ''


def banner(device: torch.device, device_arg: str, world_size: int, backend: str) -> str:
    """One line: the kit, torch and its CUDA, the devices, the backend and the world size."""
    cuda = f'CUDA {torch.version.cuda}' if torch.version.cuda else \
        f'ROCm {torch.version.hip}' if getattr(torch.version, 'hip', None) else 'no CUDA'
    if device.type == 'cuda':
        devices = f'{torch.cuda.device_count()} x {torch.cuda.get_device_name(device)} on this node'
    elif str(device_arg).strip().lower().startswith('cpu'):
        devices = f'cpu (--device {str(device_arg).strip()})'
    else:  # no --device and no usable GPU: the CPU, as train_dual.py does, but not silently
        devices = f'cpu (no usable GPU: {cuda_unusable_reason() or "none visible"})'
    return (f'yolov9-ddp {__version__}: torch {torch.__version__} ({cuda}), devices {devices}, '
            f'backend {backend if world_size > 1 else "none (one process)"}, world size {world_size}')
