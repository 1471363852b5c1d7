"""What happens around the training loop's steps and epochs, one small part a concern, as detectron2's hooks: the
Trainer calls each part at fixed points, in the order standard() gives, and a part acts at the points it defines.

    PeriodicCheckpoint   last.pt every --checkpoint-steps / --checkpoint-minutes      after a step
    EpochEnd             EMA and BatchNorm sync, validation, best and last           after an epoch
    StopOnSignal         SIGTERM/SIGINT: every rank stops after the same step        after a step or an epoch
    Finish               strip the checkpoints, validate best.pt, the final line     after training

Tests add their own parts at the same points (testsupport/probes/faulty_train.py injects faults so).
"""


class Part:
    """One concern of a run, called by the Trainer; each method is a point, and a part defines the ones it acts at.
    step is the number of the epoch's global batches trained so far (after_step) or about to be (before_step)."""

    def before_train(self, trainer):
        pass

    def before_step(self, trainer, epoch: int, step: int):
        pass

    def after_step(self, trainer, epoch: int, step: int):
        pass

    def after_epoch(self, trainer, epoch: int):
        pass

    def after_train(self, trainer):
        pass

    def close(self, trainer):
        """On every way out of the run, a failure too."""


def acts_at(part: Part, point: str) -> bool:
    return getattr(type(part), point) is not getattr(Part, point)


def standard(opt, cuda: bool) -> list:
    from yolov9_ddp.parts.epoch_end import EpochEnd
    from yolov9_ddp.parts.finish import Finish
    from yolov9_ddp.parts.periodic import PeriodicCheckpoint
    from yolov9_ddp.parts.signals import StopOnSignal
    return [PeriodicCheckpoint(opt.checkpoint_steps, opt.checkpoint_minutes, cuda), EpochEnd(),
            StopOnSignal(cuda, opt.save_on_signal), Finish()]
