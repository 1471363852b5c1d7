"""--checkpoint-steps N / --checkpoint-minutes M: a resumable last.pt at the first optimizer-step boundary once N
optimizer steps or M minutes have passed, so that a SIGKILL (the OOM killer, a lost node) costs that much training.
Rank 0's clock decides the minutes, and every rank learns it in one small all_reduce (the checkpoint is a collective
mid-epoch); a write still running when one is due makes that one skipped (checkpoints.Checkpoints)."""
from yolov9_ddp import comm, shutdown
from yolov9_ddp.parts import Part


class PeriodicCheckpoint(Part):
    def __init__(self, steps: int, minutes: float, cuda: bool):
        self.steps, self.minutes = steps, minutes
        self.check_every = shutdown.CHECK_EVERY_CUDA if cuda else 1  # on CUDA the agreement waits for the GPU
        self.due = False

    def after_step(self, trainer, epoch: int, step: int):
        if not (self.steps or self.minutes):
            return
        if self.minutes and (step - 1 + trainer.nb * epoch) % self.check_every == 0:
            passed = trainer.primary and trainer.checkpoints.minutes_since_asked() >= self.minutes
            self.due |= bool(comm.max_over_ranks(int(passed)))
        if not trainer.at_boundary(epoch, step):
            return
        if self.due or (self.steps and trainer.ema.updates % self.steps == 0):
            self.due = False
            trainer.save(epoch, step, f'checkpoint at epoch {epoch} step {step}', skip_if_busy=True)
