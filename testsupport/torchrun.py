"""torchrun as the tests run it: `python testsupport/torchrun.py ARGS` is `torchrun ARGS`, except for three things
that are the launcher's, not the kit's.

- A worker which ignores SIGTERM is killed after $TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds instead of 30. torchrun's
  own --shutdown-timeout (torch >= 2.8) reaches only the final shutdown: a restart after a failed worker stops the
  others with the built-in 30 s (LocalElasticAgent._stop_workers), and torch 2.4 has no setting at all. A test
  waiting the full 30 s for it proves nothing more.
- Workers are forked from the launcher once it imported torch, torchvision and upstream's heaviest dependencies
  (testsupport/forked.py), not started as new interpreters: 6 s of CPU saved per worker and per restart.
- Once torchrun has returned (its workers gone, its summary printed), the launcher exits without the interpreter's
  teardown, which costs a process that imported torch 0.5 to 1 s (yolov9_ddp.failures)."""
import glob
import os
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
from torch.distributed.run import main

SCRIPT_SYS_PATH = sys.path[1:]  # a script's, after its own folder (sys.path[0] is this file's)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the kit: run as a script from a patched tree
from testsupport import forked  # noqa: E402
from yolov9_ddp.failures import exit_without_teardown  # noqa: E402

GRACE_S = int(os.environ.get('TORCH_ELASTIC_SHUTDOWN_TIMEOUT', '30'))
_close = PContext.close
_popen = SubprocessHandler._popen


def close_within_grace(self, death_sig=None, timeout=30):
    return _close(self, death_sig, min(timeout, GRACE_S))


def fork_workers():
    """Each worker that forked.forkable allows is forked from here, with forked.PRELOADED imported."""
    base_env = dict(os.environ)  # before torchrun adds OMP_NUM_THREADS to it: the threads torch was loaded with
    if base_env.get(forked.OPT_OUT) == '0':
        return
    preloaded_env = forked.preload()
    base_env.update(preloaded_env)
    if hasattr(torch, 'accelerator') and not glob.glob('/dev/nvidia[0-9]*'):
        # torchrun (>= 2.8) asks whether there is an accelerator, to bind workers to NUMA nodes, through the CUDA
        # runtime, which leaves every later fork unable to use CUDA; without an NVIDIA device the answer is no
        torch.accelerator.is_available = lambda: False

    def fork_or_popen(self, args, env):
        if not forked.forkable(args, env, base_env, preloaded_env):
            return _popen(self, args, env)
        streams = {1: self._stdout and self._stdout.fileno(), 2: self._stderr and self._stderr.fileno()}
        pid = forked.fork(args, env, streams, None, True, SCRIPT_SYS_PATH, preloaded_env)
        return forked.ForkedChild(args, pid)
    SubprocessHandler._popen = fork_or_popen


if __name__ == '__main__':
    PContext.close = close_within_grace
    fork_workers()
    exit_without_teardown(forked.exit_status(main))
