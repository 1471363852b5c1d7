"""A run's resumable state, besides the weights of the model and the EMA and the optimizer's, as one object: where
it is, its counters, the grad scaler, the EMA's update count and early stopping.

A position (epoch, step): the run has trained the first `step` global batches of `epoch` (stream.py) and stands at
an optimizer-step boundary. Besides it, a checkpoint records what the next step's arithmetic depends on that the
weights do not hold: the last optimizer step, the accumulation count, early stopping's best epoch and, mid-epoch,
each rank's own BatchNorm statistics and mean loss. No generator's state: every random choice is a function of
(seed, epoch, step, index). The checkpoint's 'epoch' stays upstream's, the last complete one; a checkpoint without a
position (upstream's own) resumes at the start of the epoch after it.
"""
import torch

from yolov9_ddp.checkpoints import CheckpointError
from yolov9_ddp.comm import Unanimous
from yolov9_ddp.ema import norm_statistics
from yolov9_ddp.hostcopy import QueuedHostCopy, scaler_state

KEY = 'position'


class PositionMismatch(CheckpointError, Unanimous):
    """A recorded position that does not fit this run: every rank reads the same checkpoint."""


class RunState:
    """The state_dict() of a run at a position goes into its checkpoint beside the model, the EMA, the optimizer and
    the options; load_state_dict() puts it back, refusing a position that does not fit this run."""

    def __init__(self, scaler, ema, stopper, images: int, global_batch: int, world: int, accumulate: int):
        self.scaler, self.ema, self.stopper = scaler, ema, stopper
        self.images, self.global_batch, self.world = images, global_batch, world
        self.epoch, self.step = 0, 0  # where this start continues the run (a resume: its checkpoint's)
        self.last_opt_step, self.accumulate = -1, accumulate
        self.best_fitness = 0.0
        self.recorded = True  # False: resumed from a checkpoint that records no position
        self.ranks = None  # per rank, rank_state(), where a resume continues mid-epoch

    def state_dict(self, epoch: int, step: int, ranks=None) -> dict:
        """The checkpoint's entries of the run at (epoch, step); ranks: every rank's rank_state() mid-epoch."""
        return {'epoch': epoch - 1, 'best_fitness': self.best_fitness, 'updates': self.ema.updates,
                'scaler': scaler_state(self.scaler), 'world_size': self.world,
                KEY: {'epoch': epoch, 'step': step, 'last_opt_step': self.last_opt_step,
                      'accumulate': int(self.accumulate), 'best_epoch': self.stopper.best_epoch,
                      'images': self.images, 'global_batch': self.global_batch, 'ranks': ranks}}

    def load_state_dict(self, ckpt: dict, source):
        self.ema.updates = ckpt['updates'] or 0  # none in a stripped checkpoint (extend.py)
        if ckpt.get('scaler'):
            self.scaler.load_state_dict(ckpt['scaler'])
        self.best_fitness = self.stopper.best_fitness = ckpt.get('best_fitness') or 0.0
        saved = ckpt.get(KEY)
        if saved is None:
            self.epoch, self.recorded = ckpt['epoch'] + 1, False
            return
        if saved['images'] != self.images:
            raise PositionMismatch(f'{source} was recorded on {saved["images"]} training images, the dataset now has '
                                   f'{self.images}: its position (epoch {saved["epoch"]}, step {saved["step"]}) does '
                                   f'not fit')
        if saved['global_batch'] != self.global_batch:
            raise PositionMismatch(f'{source} was recorded with a global batch of {saved["global_batch"]}, this run '
                                   f'has {self.global_batch}')
        self.epoch, self.step = saved['epoch'], saved['step']
        self.last_opt_step, self.accumulate = saved['last_opt_step'], saved['accumulate'] or self.accumulate
        self.stopper.best_epoch, self.ranks = saved['best_epoch'], saved['ranks']

    def describe(self, steps_per_epoch: int, source) -> str:
        if not self.recorded:
            return f'resuming epoch {self.epoch} at its start: {source} records no step'
        return f'resuming epoch {self.epoch} at step {self.step} of {steps_per_epoch} from {source}'


def rank_state(model, ema_model, mean_loss) -> dict:
    """This rank's own state between two BatchNorm synchronisations (ema.py): copies on its device, taken in the
    stream's order without waiting for the GPU (a checkpoint's host copy takes them with its other tensors)."""
    return {'norm': [t.detach().clone() for t in norm_statistics(model)],
            'ema_norm': [t.detach().clone() for t in norm_statistics(ema_model)],
            'mean_loss': mean_loss.detach().clone()}


def in_host_memory(state: dict) -> dict:
    """rank_state() in host memory, for the other ranks to gather: its tensors copied with one wait for the GPU."""
    return QueuedHostCopy(state).result()


def restore_rank_state(ranks: list, rank: int, world: int, model, ema_model):
    """Put this rank's recorded statistics back and return its mean loss. On another number of processes no rank's
    own statistics exist: every rank takes their mean, as the epoch's synchronisation would have given."""
    chosen = [ranks[rank]] if len(ranks) == world else ranks
    with torch.no_grad():
        for name, module in (('norm', model), ('ema_norm', ema_model)):
            for buffer, *values in zip(norm_statistics(module), *(r[name] for r in chosen)):
                buffer.copy_(torch.stack(values).mean(0))
    return chosen[0]['mean_loss']
