"""The end of every epoch: the EMA and the BatchNorm statistics averaged over the ranks (ema.py), validation on
every rank's shard, the best fitness and early stopping, the loggers' epoch, then last.pt (best.pt and epochN.pt as
its copies) written off the training thread: the next epoch starts while the write runs. The run's last epoch
writes it stripped, as the finish leaves it, where it can (EpochEnd.save)."""
import time

import torch

from utils.general import LOGGER
from yolov9_ddp import comm
from yolov9_ddp.checkpoints import copy_file
from yolov9_ddp.ema import synchronize_ema
from yolov9_ddp.parts import Part

EMA_ATTRIBUTES = ['yaml', 'nc', 'hyp', 'names', 'stride', 'class_weights']


class EpochEnd(Part):
    def after_epoch(self, trainer, epoch: int):
        opt, run = trainer.opt, trainer.state
        started = time.time()
        trainer.callbacks.run('on_train_epoch_end', epoch=epoch)
        synchronize_ema(trainer.ema, trainer.raw_model)
        trainer.ema.update_attr(trainer.raw_model, include=EMA_ATTRIBUTES)
        final = epoch + 1 == opt.epochs or run.stopper.possible_stop
        if not opt.noval or final:
            trainer.results, trainer.maps, _ = trainer.validate(trainer.ema.ema, plots=False)
        validated = time.time()
        fitness = trainer.task.fitness(trainer.results)
        trainer.stop_early = run.stopper(epoch=epoch, fitness=fitness)  # the same results on every rank
        run.best_fitness = max(run.best_fitness, fitness)
        trainer.callbacks.run('on_fit_epoch_end', list(trainer.mloss) + list(trainer.results) + trainer.lr, epoch,
                              run.best_fitness, fitness)
        if not opt.nosave or final:
            self.save(trainer, epoch, final, fitness)
        memory = memory_report(trainer)  # a collective: every rank takes part
        images = len(trainer.dataset)
        LOGGER.info(f'epoch {epoch}: {images} images in {trainer.trained_s:.1f} s '
                    f'({images / trainer.trained_s:.1f} img/s); validation {validated - started:.2f} s, '
                    f'epoch end {time.time() - started:.2f} s{memory}')

    @staticmethod
    def save(trainer, epoch: int, final: bool, fitness: float):
        """last.pt at the start of the next epoch; once it is in place, its copies and the loggers' model save. The
        run's last epoch writes it stripped at once where the task strips it in place (no whole file to wait for,
        read back and strip at the finish), but where an epochN.pt, a whole checkpoint, is due too."""
        last, then = trainer.last, []
        if fitness == trainer.state.best_fitness:
            then.append(lambda: copy_file(last, trainer.best))
        numbered = trainer.opt.save_period > 0 and epoch % trainer.opt.save_period == 0
        if numbered:
            then.append(lambda: copy_file(last, trainer.weights_dir / f'epoch{epoch}.pt'))
        best_fitness = trainer.state.best_fitness
        then.append(lambda: trainer.callbacks.run('on_model_save', last, epoch, final, best_fitness, fitness))
        last_epoch = epoch + 1 == trainer.opt.epochs or trainer.stop_early
        trainer.save(epoch + 1, 0, f'checkpoint of epoch {epoch}', then,
                     strip=last_epoch and trainer.task.stripped(last) == last and not numbered)


def memory_report(trainer) -> str:
    if not trainer.cuda:
        return ''
    peaks = comm.all_gather_object(torch.cuda.max_memory_reserved(trainer.device) // 2 ** 20)
    return '; peak reserved MiB per rank ' + ', '.join(map(str, peaks))
