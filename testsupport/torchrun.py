"""torchrun with a grace period the tests set: `python -m testsupport.torchrun ARGS` is `torchrun ARGS`, except
that a worker which ignores SIGTERM is killed after $TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds instead of 30.

torchrun's own --shutdown-timeout (torch >= 2.8) reaches only the final shutdown: a restart after a failed worker
stops the others with the built-in 30 s (LocalElasticAgent._stop_workers), and torch 2.4 has no setting at all.
The grace is the launcher's, not the kit's: a test waiting the full 30 s for it proves nothing more."""
import os
import sys

from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.run import main

GRACE_S = int(os.environ.get('TORCH_ELASTIC_SHUTDOWN_TIMEOUT', '30'))
_close = PContext.close


def close_within_grace(self, death_sig=None, timeout=30):
    return _close(self, death_sig, min(timeout, GRACE_S))


if __name__ == '__main__':
    PContext.close = close_within_grace
    sys.exit(main())
