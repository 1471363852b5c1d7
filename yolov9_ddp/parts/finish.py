"""The end of training: the last write completes; rank 0 strips last.pt and best.pt as upstream's script leaves
them (where the last epoch's write left them whole) and marks the run finished (only then: a restart before it
resumes from last.previous.pt); every rank validates best.pt with plots, and the final line names its metrics."""
import filecmp

from utils.general import LOGGER, colorstr
from yolov9_ddp import comm, runs
from yolov9_ddp.checkpoints import copy_file, final_model, load_checkpoint, load_everywhere
from yolov9_ddp.files import previous_path
from yolov9_ddp.parts import Part


class Finish(Part):
    def before_train(self, trainer):
        if trainer.primary:  # a finished run extended (extend.py) trains again
            runs.write_record(trainer.save_dir, finished=False)

    def after_train(self, trainer):
        last, best = trainer.last, trainer.best
        if trainer.primary:
            trainer.checkpoints.wait()
            strip_final_checkpoints(trainer)
            runs.write_record(trainer.save_dir, finished=True)
            previous_path(last).unlink(missing_ok=True)
        if comm.broadcast_object(best.exists()):
            saved = load_everywhere(lambda: load_checkpoint(best))
            model = final_model(saved).to(trainer.device).float().fuse().eval()
            LOGGER.info(f'\nValidating {best}...')
            trainer.results, _, _ = trainer.validate(model.half() if trainer.amp else model,
                                                     plots=not trainer.opt.noplots)
        trainer.callbacks.run('on_train_end', last, best, trainer.state.epoch - 1, trainer.results)
        LOGGER.info(f'{colorstr("bold", "Final:")} {trainer.task.summary(trainer.results)}  ({best})')


def strip_final_checkpoints(trainer):
    """Upstream's stripped last.pt and best.pt (train.py names them *_striped.pt, the others strip them
    in place); where best.pt is the last epoch's checkpoint (the same bytes), its stripped file is a copy of
    last.pt's, not loaded and stripped again. The last epoch's went out stripped already where it could (epoch_end.py),
    and best.pt as its copy."""
    last, best, stripped = trainer.last, trainer.best, trainer.task.stripped
    written_stripped = trainer.checkpoints.stripped_written == last
    best_is_last = last.exists() and best.exists() and filecmp.cmp(last, best, shallow=False)
    for source in (last, best):
        if not source.exists():
            continue
        if source == best and best_is_last:
            if not written_stripped:
                copy_file(stripped(last), stripped(best))
        elif not (source == last and written_stripped):
            trainer.checkpoints.strip(source, stripped(source))
        size = stripped(source).stat().st_size / 1E6
        LOGGER.info(f'Optimizer stripped from {source}, saved as {stripped(source)}, {size:.1f}MB')
