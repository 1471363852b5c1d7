"""SIGTERM / SIGINT (a scheduler's pre-emption, Ctrl-C, torchrun stopping its workers): every rank stops after the
same step, the first optimizer-step boundary from where all learnt of the signal (shutdown.StopRequest), and, with
--save-on-signal, rank 0 first writes a resumable last.pt of that position. A signal in an epoch's last steps, after
its last optimizer step, stops the run once the epoch's end is done."""
from yolov9_ddp import shutdown
from yolov9_ddp.parts import Part


class StopOnSignal(Part):
    def __init__(self, cuda: bool, save: bool):
        self.request = shutdown.StopRequest(shutdown.CHECK_EVERY_CUDA if cuda else 1)  # handles the signals from now
        self.save, self.signum = save, 0

    def after_step(self, trainer, epoch: int, step: int):
        self.signum = self.signum or self.request.agreed(step - 1 + trainer.nb * epoch)
        if self.signum and trainer.at_boundary(epoch, step):
            self.stop(trainer, epoch, step)

    def after_epoch(self, trainer, epoch: int):
        if self.signum:
            self.stop(trainer, epoch + 1, 0)

    def stop(self, trainer, epoch: int, step: int):
        saved = None
        if self.save:
            trainer.save(epoch, step, f'checkpoint at epoch {epoch} step {step}')
            if trainer.primary:
                trainer.checkpoints.wait()
            saved = trainer.last
        raise shutdown.Interrupted(self.signum, saved)

    def close(self, trainer):
        self.request.close()
