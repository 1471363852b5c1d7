"""Where a run is (issue 21; DESIGN.md "A checkpoint is a position"): what a resumable checkpoint records besides
the weights, optimizer, EMA and grad scaler, and where a start continues from it.

A position is (epoch, step): the run has trained the first `step` global batches of `epoch` (yolov9_ddp.stream) and
stands at an optimizer-step boundary, no gradient pending. step may be the epoch's last: its end (validation,
saving) is then still to come. The rest is what the next step's arithmetic depends on that the weights do not hold:
the step of the last optimizer step and the accumulation count (warmup ramps it up), early stopping's best epoch,
and, between two epochs' BatchNorm synchronisation, each rank's own normalisation statistics (of the model and of
the EMA) and running mean loss. Every other random choice is a function of (seed, epoch, step, index).

The checkpoint's own 'epoch' stays upstream's: the last complete epoch, so upstream's scripts resume our files at
the start of the interrupted epoch. A checkpoint of an earlier kit has no position: it resumes at the start of
the epoch after its 'epoch', as before.
"""
from dataclasses import asdict, dataclass

import torch

from yolov9_ddp.checkpoint import CheckpointError, QueuedHostCopy
from yolov9_ddp.comm import Unanimous
from yolov9_ddp.ema import norm_statistics

KEY = 'position'


class PositionMismatch(CheckpointError, Unanimous):
    """A recorded position that does not fit this run: every rank reads the same checkpoint."""


@dataclass(frozen=True)
class Position:
    epoch: int
    step: int = 0
    last_opt_step: int = -1  # the global step of the last optimizer step
    accumulate: int = None  # micro-steps per optimizer step; None: the run's initial one
    best_epoch: int = 0  # early stopping's
    images: int = None  # the size of the training set it was recorded on
    global_batch: int = None
    ranks: list = None  # per rank, rank_state(); None at an epoch's end, where the ranks were synchronised
    recorded: bool = True  # False: a checkpoint of an earlier kit, which records no position


def record(position: Position) -> dict:
    """What a checkpoint keeps: plain values and tensors (readable without the kit, as upstream's files)."""
    return {k: v for k, v in asdict(position).items() if k != 'recorded'}


def resume_point(ckpt: dict, images: int, global_batch: int, source) -> Position:
    """Where a resume from ckpt starts; a position that does not fit this run is refused, before anything is
    written."""
    saved = ckpt.get(KEY)
    if saved is None:
        return Position(epoch=ckpt['epoch'] + 1, recorded=False)
    position = Position(**saved)
    if position.images != images:
        raise PositionMismatch(f'{source} was recorded on {position.images} training images, the dataset now has '
                               f'{images}: its position (epoch {position.epoch}, step {position.step}) does not fit')
    if position.global_batch != global_batch:
        raise PositionMismatch(f'{source} was recorded with a global batch of {position.global_batch}, this run has '
                               f'{global_batch}')
    return position


def describe(position: Position, steps_per_epoch: int, source) -> str:
    if not position.recorded:
        return (f'resuming epoch {position.epoch} at its start: {source} is a checkpoint of an earlier kit, which '
                f'records no step')
    return f'resuming epoch {position.epoch} at step {position.step} of {steps_per_epoch} from {source}'


def rank_state(model, ema_model, mean_loss) -> dict:
    """This rank's own state between two BatchNorm synchronisations (yolov9_ddp.ema): copies on its device, taken in
    the stream's order without waiting for the GPU (a checkpoint's host copy takes them with its other tensors). A
    copy to the host each was a wait each: 1,165 for yolov9-s and its EMA, at every periodic checkpoint."""
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
