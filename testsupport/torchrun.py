"""torchrun with a grace period the tests set: `python -m testsupport.torchrun ARGS` is `torchrun ARGS`, except
that a worker which ignores SIGTERM is killed after $TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds instead of 30.

torchrun's own --shutdown-timeout (torch >= 2.8) reaches only the final shutdown: a restart after a failed worker
stops the others with the built-in 30 s (LocalElasticAgent._stop_workers), and torch 2.4 has no setting at all.
The grace is the launcher's, not the kit's: a test waiting the full 30 s for it proves nothing more. So is the
launcher's own exit: once torchrun has returned (its workers gone, its summary printed), it exits without the
interpreter's teardown, which costs a process that imported torch 0.5 to 1 s (yolov9_ddp.failures)."""
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.run import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the kit: run as a script from a patched tree
from yolov9_ddp.failures import exit_without_teardown  # noqa: E402

GRACE_S = int(os.environ.get('TORCH_ELASTIC_SHUTDOWN_TIMEOUT', '30'))
_close = PContext.close


def close_within_grace(self, death_sig=None, timeout=30):
    return _close(self, death_sig, min(timeout, GRACE_S))


def exit_status(main) -> int:
    """main()'s exit status as the interpreter would give it: an exception's traceback printed, then 1."""
    try:
        main()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


if __name__ == '__main__':
    PContext.close = close_within_grace
    exit_without_teardown(exit_status(main))
