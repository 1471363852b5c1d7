"""One experiment log across the starts of a run (--resume, --auto-resume, a torchrun restart, a Slurm requeue), on
rank 0, the only rank with loggers. results.csv and TensorBoard: the run folder keeps one log of each, and a start
that continues at epoch E drops what an earlier start logged from E on (SummaryWriter's purge_step for TensorBoard),
so that each epoch shows once. W&B: every start continues the run's one W&B run, whose id run.json keeps
(WANDB_RUN_ID, WANDB_RESUME=allow, read by the wandb.init of upstream's loggers)."""
import os
import uuid
from pathlib import Path

from yolov9_ddp import runs
from yolov9_ddp.files import atomic_write


def continue_wandb_run(save_dir):
    """Before upstream's loggers are made: the run's W&B id, made at its first start, for every start of it."""
    run_id = runs.read_record(save_dir).get('wandb_id')
    if run_id is None:
        run_id = uuid.uuid4().hex[:8]
        runs.write_record(save_dir, wandb_id=run_id)
    os.environ.setdefault('WANDB_RUN_ID', run_id)
    os.environ.setdefault('WANDB_RESUME', 'allow')


def logged_before(save_dir) -> bool:
    """Whether an earlier start of the run wrote a TensorBoard log in its folder."""
    return any(Path(save_dir).glob('events.out.tfevents.*'))


def continue_tensorboard(loggers, save_dir, epoch: int):
    """The TensorBoard writer of upstream's loggers (GenericLogger's for segmentation), made again to purge the
    events of epoch and later from the log."""
    owner = loggers if hasattr(loggers, 'tb') else loggers.logger
    if getattr(owner, 'tb', None) is None:
        return
    from torch.utils.tensorboard import SummaryWriter
    owner.tb.close()
    owner.tb = SummaryWriter(str(save_dir), purge_step=epoch)


def continue_results_csv(save_dir, epoch: int):
    """results.csv without the rows of epoch and later (upstream's loggers append one an epoch): an earlier start
    logged them and was stopped before their checkpoint, and this start trains those epochs again."""
    path = Path(save_dir) / 'results.csv'
    if not path.is_file():
        return
    header, *rows = path.read_text().splitlines(keepends=True) or ['']
    kept = [row for row in rows if logged_epoch(row) < epoch]
    if len(kept) < len(rows):
        atomic_write(path, lambda f: f.write(''.join([header, *kept]).encode()))


def logged_epoch(row: str) -> float:
    """The epoch of a results.csv row (its first column); a row cut short by a kill counts as the latest."""
    try:
        return float(row.split(',', 1)[0])
    except ValueError:
        return float('inf')
