"""`--resume RUN/weights/last.pt --epochs N`: a finished or stopped run goes on to N epochs in all.

From the epoch it stands at, the learning rate follows the schedule of N epochs (upstream's, as if the run had been
started with --epochs N), and opt.yaml records the new total and, under `extended`, when and from what it changed.
A finished run's last.pt is stripped as upstream's scripts strip it (no optimizer, the EMA as the model): it goes on
from those EMA weights with a new optimizer state, and says so. Every other option of the run stays its own.
"""
from yolov9_ddp.cli import UsageError


def new_total(opt, plan):
    """The run's recorded total of epochs where this start's --epochs changes it, else None."""
    recorded = (plan.options or {}).get('epochs')
    return recorded if plan.resume_from is not None and recorded not in (None, opt.epochs) else None


def begin(opt, run, recorded_total: int, stripped: bool, log):
    """The run, at run.epoch, now trains to opt.epochs: checked, said in one line, recorded into opt."""
    if opt.epochs <= run.epoch:
        raise UsageError(f'--epochs {opt.epochs}: the run has trained {run.epoch} epochs already; give more to train '
                         f'it further')
    start = 'its final EMA weights with a new optimizer state' if stripped else 'where it stands'
    log(f'extending the run from {recorded_total} to {opt.epochs} epochs at epoch {run.epoch}, from {start}: the '
        f'learning rate follows the schedule of {opt.epochs} epochs from here')
    earlier = getattr(opt, 'extended', None) or []
    opt.extended = [*earlier, {'at_epoch': run.epoch, 'from': recorded_total, 'to': opt.epochs}]
