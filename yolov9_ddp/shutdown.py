"""Clean shutdown on SIGTERM / SIGINT (a scheduler's pre-emption, Ctrl-C, torchrun stopping its workers).

The handler only records the signal; all ranks learn in one small all_reduce whether any was signalled, and stop
after the same step (parts/signals.py), so that none waits in a collective for one that has gone. A second SIGINT
interrupts at once; a second SIGTERM is the same request twice (Slurm and torchrun both pass theirs on).
"""
import os
import signal

from yolov9_ddp import comm

CHECK_EVERY_CUDA = 10  # steps; on CUDA the check is a small all_reduce and a GPU sync, so not every step
HANDLED = (signal.SIGTERM, signal.SIGINT)


class Interrupted(Exception):
    """Training stopped on a signal; exit status 128 + signal number, as a shell reports a signal death."""

    def __init__(self, signum: int, saved=None):
        self.signum, self.saved = signum, saved
        name = signal.Signals(signum).name
        super().__init__(f'stopped on {name}' + (f'; resumable checkpoint written to {saved}' if saved else
                                                 '; no checkpoint written for the interrupted epoch'))

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopRequest:
    def __init__(self, check_every: int):
        self.signum, self.pid, self.check_every = None, os.getpid(), check_every
        self.previous = {s: signal.signal(s, self.record) for s in HANDLED}

    def record(self, signum, frame):
        if os.getpid() != self.pid:  # a forked child (a label-cache pool worker) inherited the handler: die as usual
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is None:
            self.signum = signum
        elif signum != signal.SIGTERM:
            raise KeyboardInterrupt  # a second signal: stop now

    def agreed(self, step: int) -> int:
        """At every check_every-th step, the signal any rank received (or 0); elsewhere 0."""
        if step % self.check_every:
            return 0
        return comm.max_over_ranks(self.signum or 0)

    def close(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
