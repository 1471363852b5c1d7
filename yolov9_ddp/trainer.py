"""The one training loop of the kit's entry points (ddp_train.py, ddp_train_dual.py, ddp_train_triple.py,
segment/ddp_train.py, segment/ddp_train_dual.py): setup, epochs of train_step() with validate() and save(), on one
process or many (torchrun). What differs between upstream's training scripts is a task (yolov9_ddp.tasks).

Imported from a patched YOLOv9 clone: upstream's modules come from the clone, the kit's from yolov9_ddp/ in it.
"""
import filecmp
import gc
import inspect
import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.optim import lr_scheduler
from tqdm import tqdm

from utils.autobatch import check_train_batch_size
from utils.callbacks import Callbacks
from utils.general import (LOGGER, TQDM_BAR_FORMAT, check_dataset, check_img_size, check_yaml, colorstr,
                           get_latest_run, increment_path, init_seeds, intersect_dicts, labels_to_class_weights,
                           labels_to_image_weights, methods, one_cycle, one_flat_cycle, strip_optimizer,
                           yaml_save)
from utils.torch_utils import EarlyStopping, ModelEMA, smart_optimizer
from yolov9_ddp import (checkpoint, checkpoint_process, cli, comm, data, failures, graphs, perf, position, runs,
                        shutdown, slurm, stream)
from yolov9_ddp.demo_data import ensure_demo_dataset
from yolov9_ddp.ema import EmaUpdater, synchronize_ema
from yolov9_ddp.progress import PROGRESS_EVERY, LaggingLosses

NOMINAL_BATCH = 64  # upstream's nbs: gradients are accumulated up to this many images per optimizer step


# -- setup ---------------------------------------------------------------------------------------------------------

def configure_logging():
    """Rank 0 logs as upstream; other ranks keep warnings and errors only, prefixed with their rank."""
    rank = comm.launched_rank()  # also before the process group exists
    if rank == 0:
        return
    LOGGER.setLevel(logging.WARNING)
    for handler in LOGGER.handlers:  # upstream's set_logging() gave them level ERROR on ranks other than 0
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter(f'[rank {rank}] %(message)s'))


def resolve_data(task, opt) -> str:
    """--data, or the task's demo dataset (generated once per node, rank 0 first)."""
    if not cli.uses_demo(opt):
        return opt.data
    folder = opt.demo_dir or Path(opt.project).parent / task.demo_folder
    yaml_path = comm.run_staged(lambda: ensure_demo_dataset(folder, task.demo_spec, log=LOGGER.info))
    if cli.names_no_model(opt):  # no model named either: the kit's tiny one for this task
        opt.cfg = str(cli.MODELS / task.demo_cfg)
    return str(yaml_path)


def resolve_model_files(opt):
    try:
        opt.cfg = check_yaml(opt.cfg) if opt.cfg else ''
    except AssertionError as e:
        raise cli.UsageError(f'--cfg {opt.cfg}: {e}') from e
    if not opt.cfg and not opt.weights:
        raise cli.UsageError('either --cfg or --weights must be specified')


def autobatch(model, imgsz: int, amp: bool) -> int:
    """AutoBatch's batch (upstream's check_train_batch_size), measured with cudnn.benchmark off: upstream's
    autobatch() answers its default, 16, without measuring while benchmark is on (its workspaces would distort the
    memory profile, ultralytics/yolov5#9287), and benchmark is the kit's default lever. It aims at 80% of the free
    memory, which leaves the rest to the benchmark's workspaces: on an H200 it chose 148 for yolov9-s at 640 px, and
    an epoch at it reserved 65 of 140 GB (bench/RESULTS.md, 2026-12-05)."""
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        return check_train_batch_size(model, imgsz, amp)
    finally:
        torch.backends.cudnn.benchmark = benchmark


def restore_resumed_options(opt, plan, given: dict):
    """On resume, take the run's saved options (as upstream), this start's own where its command line gives them
    (yolov9_ddp.runs); one line names the given flags that the run's own values overrule. --deterministic, once
    set, is kept, and a resume may set it."""
    overruled = runs.overruled_flags(vars(opt), plan.options, given)
    resumed = runs.resumed_options(vars(opt), plan.options, given)
    resumed['deterministic'] = opt.deterministic or bool(plan.options.get('deterministic'))
    try:
        given_levers = perf.requested({**vars(opt), 'deterministic': resumed['deterministic']})
    except ValueError as e:
        raise cli.UsageError(f'{e} (the run in {plan.save_dir} is deterministic)') from e
    vars(opt).update(resumed)
    opt.levers = perf.resumed(plan.options, given_levers, opt, comm.launched_world_size(), LOGGER.info)
    opt.resume, opt.weights = True, str(plan.resume_from)
    if opt.cfg and not Path(opt.cfg).is_file():  # a relative path from another folder: the checkpoint's own yaml
        opt.cfg = ''
    if overruled and comm.launched_rank() == 0:
        LOGGER.warning(f"WARNING: a resumed run keeps its own options (opt.yaml), so these flags are ignored: "
                       f"{', '.join(overruled)}")


def plan_run(opt) -> runs.RunPlan:
    """The run folder (runs.plan_run) and, for a resume, the run's saved options: rank 0 reads them."""
    plan = runs.plan_run(opt, get_latest_run, increment_path)
    return plan if plan.resume_from is None else replace(plan, options=runs.saved_options(plan))


def plan_start(opt, given: dict = None) -> runs.RunPlan:
    """Before the process group: rank 0 decides the run, every rank learns it, and a resume takes the run's own
    options, so that the checks and the device of every rank are the run's, not the command line's defaults (issue
    21). given: the flags the command line gives (cli.given_flags)."""
    configure_logging()
    plan = comm.rank0_decides(lambda: plan_run(opt), opt.ddp_timeout)
    if plan.resume_from is not None:
        restore_resumed_options(opt, plan, given or {})
    return plan


def create_run(plan: runs.RunPlan):
    """Rank 0 creates the run folder and records the start (nothing is written before the checks pass)."""
    error = None
    if comm.is_primary() and not plan.finished:
        try:
            runs.start_record(plan)
            checkpoint.remove_stale_temporaries(plan.save_dir / 'weights')  # of a writer killed mid-save
        except (OSError, runs.RunBusy) as e:
            error = e
    comm.raise_if_any_failed(error)


def load_everywhere(load) -> dict:
    """Rank 0 reads a checkpoint with load() and sends it to the others (nodes need not share a filesystem)."""
    ckpt, error = None, None
    if comm.is_primary():
        try:
            ckpt = load()
        except checkpoint.CheckpointError as e:
            error = e
    comm.raise_if_any_failed(error)
    return comm.broadcast_object(ckpt)


def load_exactly(model, saved, source):
    """A resume continues the same model: every tensor must match, or the checkpoint belongs to another model."""
    try:
        model.load_state_dict(saved.float().state_dict(), strict=True)
    except RuntimeError as e:
        detail = ' '.join(str(e).split())[:300]
        raise checkpoint.ModelMismatch(f'{source} holds another model than this run ({detail})') from e


def strip_atomically(path: Path, dest: Path):
    """Upstream's strip_optimizer(path, dest) writes dest in place; a kill meanwhile would truncate it (dest is path
    itself for train_dual.py and the segment scripts, path_striped.pt for train.py and train_triple.py).

    Its log line would name the temporary file, so it is held back and the line says where the result is."""
    tmp = checkpoint.temporary_path(dest)
    was_disabled, LOGGER.disabled = LOGGER.disabled, True
    try:
        strip_optimizer(str(path), str(tmp))
        os.replace(tmp, dest)
    finally:
        LOGGER.disabled = was_disabled
        tmp.unlink(missing_ok=True)
    log_stripped(path, dest)


def log_stripped(path: Path, dest: Path):
    LOGGER.info(f'Optimizer stripped from {path}, saved as {dest}, {dest.stat().st_size / 1E6:.1f}MB')


def rank_local_buffers() -> dict:
    """DDP option that stops the per-forward broadcast of buffers (BatchNorm statistics stay per rank and are
    averaged each epoch, see yolov9_ddp.ema); torch >= 2.14 renamed broadcast_buffers to forward_sync_buffers."""
    if 'forward_sync_buffers' in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {'forward_sync_buffers': False}
    return {'broadcast_buffers': False}


# -- the trainer ---------------------------------------------------------------------------------------------------

def periodic_writer(task) -> checkpoint.CheckpointWriter:
    """A writer of periodic checkpoints: a child process, which imports the task's model classes as it starts (their
    unpickling would at the first checkpoint)."""
    process = checkpoint_process.WriterProcess(LOGGER.warning, preload=(task.model_module,))
    return checkpoint.CheckpointWriter(LOGGER.warning, process)


class Trainer:
    """One training run of a task: setup(), then fit() runs epochs of train_step() with validate() and save()."""

    def __init__(self, task, opt, device, plan):
        self.task, self.opt, self.device, self.plan = task, opt, device, plan
        self.rank, self.world = comm.get_rank(), comm.get_world_size()
        self.primary = self.rank == 0
        self.save_dir = plan.save_dir
        self.weights_dir = self.save_dir / 'weights'
        self.last, self.best = self.weights_dir / 'last.pt', self.weights_dir / 'best.pt'
        self.callbacks = Callbacks()  # actions registered on rank 0 only: other ranks log nothing
        self.perf = perf.for_run(opt, self.world, task)  # into opt.yaml, checkpoints
        self.cuda = device.type == 'cuda'
        self.stop = shutdown.StopRequest(shutdown.CHECK_EVERY_CUDA if self.cuda else 1)
        self.writer = periodic_writer(task)  # rank 0's periodic checkpoints
        self.best_fitness = 0.0
        self.start = position.Position(epoch=0)  # where this start continues the run (a resume: its checkpoint's)
        self.pending_signal, self.checkpoint_pending, self.last_checkpoint_time = 0, False, time.monotonic()
        self.results = task.empty_results()  # the metrics, then the validation losses

    # setup -----------------------------------------------------------------------------------------------------

    def setup(self):
        opt = self.opt
        if self.primary and (opt.checkpoint_steps or opt.checkpoint_minutes):
            self.writer.start_process()  # the lever checkpoint_process: its imports while the run sets up
        self.hyp = self.load_hyp()
        if self.primary:
            yaml_save(self.save_dir / 'hyp.yaml', self.hyp)
            self.save_options()
            loggers = self.task.loggers(self.save_dir, opt, self.hyp, LOGGER)
            for action in methods(loggers):
                self.callbacks.register_action(action, callback=getattr(loggers, action))
        self.callbacks.run('on_pretrain_routine_start')
        init_seeds(opt.seed + 1 + self.rank)
        said = perf.apply_to_torch(self.perf, opt.seed + 1 + self.rank, opt.deterministic)
        if said:
            LOGGER.info(said)
        self.data_dict = comm.run_staged(self.check_data)  # may download: rank 0 first
        self.nc = 1 if opt.single_cls else int(self.data_dict['nc'])
        names = self.data_dict['names']
        self.names = {0: 'item'} if opt.single_cls and len(names) != 1 else names
        ckpt = load_everywhere(self.initial_checkpoint) if opt.weights.endswith('.pt') else None
        self.build_model(ckpt)
        self.amp = self.cuda  # upstream's check_amp() passes on every CUDA device
        gs = max(int(self.model.stride.max()), 32)
        self.imgsz = check_img_size(opt.imgsz, gs, floor=gs * 2)
        self.batch_size = self.resolve_batch_size()
        self.build_optimizer()
        self.build_loaders(gs)
        self.wrap_model()  # DDP makes every rank's weights rank 0's
        self.forward = graphs.GraphedModel(self.model) if self.perf.cuda_graphs else self.model
        self.ema = ModelEMA(self.raw_model)  # so the EMA starts identical on every rank
        self.update_ema = EmaUpdater(self.ema, self.raw_model)
        self.scaler = torch.amp.GradScaler('cuda', enabled=self.amp)
        if ckpt is not None and opt.resume:
            self.restore(ckpt)
        del ckpt
        self.compute_loss = self.task.loss(self.raw_model, opt, self.perf)
        self.init_loop_state()
        freeze_long_lived_objects()

    def initial_checkpoint(self):
        path = Path(self.opt.weights)
        if not self.opt.resume:
            return checkpoint.load_checkpoint(path)
        ckpt, source = checkpoint.load_for_resume(path, LOGGER.warning)
        self.opt.weights = str(source)
        return ckpt

    def check_data(self):
        try:
            return check_dataset(self.opt.data)
        except Exception as e:  # upstream reports a bad data yaml with assertions and bare exceptions
            raise cli.UsageError(f'--data {self.opt.data}: {e}') from e

    def load_hyp(self):
        hyp = self.opt.hyp if isinstance(self.opt.hyp, dict) else yaml.safe_load(Path(self.opt.hyp).read_text())
        hyp['anchor_t'] = 5.0  # as train_dual.py
        hyp['label_smoothing'] = self.opt.label_smoothing
        LOGGER.info(colorstr('hyperparameters: ') + ', '.join(f'{k}={v}' for k, v in hyp.items()))
        self.opt.hyp = hyp.copy()
        return hyp

    def build_model(self, ckpt):
        opt, hyp = self.opt, self.hyp
        cfg = opt.cfg or ckpt['model'].yaml
        wrong = self.task.wrong_entry_point(cli.head_of(cfg))
        if wrong:
            raise cli.UsageError(wrong)
        model = self.task.model(cfg, self.nc, hyp).to(self.device)
        if ckpt is not None and opt.resume:
            load_exactly(model, ckpt['model'], opt.weights)
        elif ckpt is not None:  # pretrained weights: transfer what fits, as upstream
            exclude = ['anchor'] if opt.cfg or hyp.get('anchors') else []
            state = intersect_dicts(ckpt['model'].float().state_dict(), model.state_dict(), exclude=exclude)
            model.load_state_dict(state, strict=False)
            LOGGER.info(f'Transferred {len(state)}/{len(model.state_dict())} items from {opt.weights}')
        frozen = [f'model.{x}.' for x in (opt.freeze if len(opt.freeze) > 1 else range(opt.freeze[0]))]
        for name, parameter in model.named_parameters():
            if any(prefix in name for prefix in frozen):
                LOGGER.info(f'freezing {name}')
                parameter.requires_grad = False
        if self.perf.channels_last:  # before the optimizer: fused SGD needs its buffers in the weights' layout
            model.to(memory_format=torch.channels_last)
        self.model = self.raw_model = model

    def save_options(self):
        yaml_save(self.save_dir / 'opt.yaml', self.recorded_options())

    def recorded_options(self) -> dict:
        return {k: v for k, v in vars(self.opt).items() if k != 'save_dir'}

    def resolve_batch_size(self):
        """--batch-size, or AutoBatch's choice for -1, recorded as the run's batch (opt.yaml, checkpoints): a resume
        or a restart keeps it instead of sizing again, which may choose another batch on another GPU or with other
        free memory, and the run could not go on at its step (position.PositionMismatch)."""
        if self.opt.batch_size != -1:
            return self.opt.batch_size
        batch = autobatch(self.model, self.imgsz, self.amp)  # one process only (checked in cli)
        self.callbacks.run('on_params_update', {'batch_size': batch})
        self.opt.batch_size = batch
        if self.primary:
            self.save_options()
        return batch

    def build_optimizer(self):
        opt, hyp = self.opt, self.hyp
        self.accumulate = max(round(NOMINAL_BATCH / self.batch_size), 1)
        hyp['weight_decay'] *= self.batch_size * self.accumulate / NOMINAL_BATCH
        self.optimizer = smart_optimizer(self.model, opt.optimizer, hyp['lr0'], hyp['momentum'], hyp['weight_decay'])
        if self.cuda and self.perf.fused_optimizer and opt.optimizer != 'LION':
            self.optimizer = perf.fused(self.optimizer)
        epochs = opt.epochs
        if opt.cos_lr:
            self.lf = one_cycle(1, hyp['lrf'], epochs)
        elif getattr(opt, 'flat_cos_lr', False):  # flags train_triple.py and the segment scripts lack
            self.lf = one_flat_cycle(1, hyp['lrf'], epochs)
        elif getattr(opt, 'fixed_lr', False):
            self.lf = lambda x: 1.0
        else:
            self.lf = lambda x: (1 - x / epochs) * (1.0 - hyp['lrf']) + hyp['lrf']
        self.scheduler = lr_scheduler.LambdaLR(self.optimizer, lr_lambda=self.lf)

    def restore(self, ckpt):
        """Continue a run: optimizer, EMA with its update count, grad scaler, best fitness and the position, with
        each rank's own statistics where it stopped mid-epoch (yolov9_ddp.position)."""
        self.optimizer.load_state_dict(ckpt['optimizer'])
        self.ema.ema.load_state_dict(ckpt['ema'].float().state_dict())
        self.ema.updates = ckpt['updates']
        if ckpt.get('scaler'):
            self.scaler.load_state_dict(ckpt['scaler'])
        self.best_fitness = ckpt.get('best_fitness') or 0.0
        self.start = position.resume_point(ckpt, len(self.dataset), self.batch_size, self.opt.weights)
        if self.start.ranks:
            self.resumed_mean_loss = position.restore_rank_state(self.start.ranks, self.rank, self.world,
                                                                 self.raw_model, self.ema.ema)
        LOGGER.info(position.describe(self.start, self.nb, self.opt.weights) + f' ({self.opt.epochs} epochs)')
        self.warn_if_batchnorm_batch_changes(ckpt.get('world_size'))  # None: a checkpoint of an earlier kit

    def warn_if_batchnorm_batch_changes(self, previous_world):
        """Without SyncBatchNorm each process normalises its own images: on another number of processes BatchNorm
        sees batches of another size, so the run's statistics (and results) change, although its global batch,
        learning rates and gradients do not."""
        if not self.primary or previous_world in (None, self.world) or (self.opt.sync_bn and self.cuda):
            return
        LOGGER.warning(f'WARNING: the run continues on {self.world} process(es) instead of {previous_world}: '
                       f'BatchNorm statistics now come from {self.batch_size // self.world} images per process, '
                       f'not {self.batch_size // previous_world}')

    def build_loaders(self, gs):
        opt, per_rank = self.opt, self.batch_size // self.world
        self.train_loader, self.dataset = data.train_loader(self.task, self.data_dict['train'], self.imgsz, per_rank,
                                                            gs, opt, self.hyp, self.cuda, colorstr('train: '))
        self.nb = self.train_loader.batch_sampler.steps  # global batches per epoch
        self.batches = data.TrainingBatches(self.train_loader, opt.epochs)
        labels = np.concatenate(self.dataset.labels, 0)
        max_class = int(labels[:, 0].max()) if len(labels) else -1
        if max_class >= self.nc:
            raise cli.UsageError(f'label class {max_class} exceeds nc={self.nc} in {opt.data}; '
                                 f'possible class labels are 0-{self.nc - 1}')
        self.val_loader = data.val_loader(self.task, self.data_dict['val'], self.imgsz, per_rank * 2, gs, opt,
                                          self.cuda, colorstr('val: '))
        if not opt.resume:
            self.model.half().float()  # pre-reduce anchor precision, as train_dual.py
        if self.primary:
            self.callbacks.run('on_pretrain_routine_end', labels, self.names)

    def wrap_model(self):
        model, opt = self.raw_model, self.opt
        model.nc, model.hyp, model.names = self.nc, self.hyp, self.names
        model.class_weights = labels_to_class_weights(self.dataset.labels, self.nc).to(self.device) * self.nc
        if self.world > 1:
            if opt.sync_bn and self.cuda:
                model = self.raw_model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(self.device)
                LOGGER.info('Using SyncBatchNorm()')
            self.model = DistributedDataParallel(model, device_ids=[self.device.index] if self.cuda else None,
                                                 gradient_as_bucket_view=True, **rank_local_buffers())

    # training ---------------------------------------------------------------------------------------------------

    def init_loop_state(self):
        start = self.start
        self.warmup_iters = max(round(self.hyp['warmup_epochs'] * self.nb), 100)
        self.last_opt_step = start.last_opt_step
        self.accumulate = start.accumulate or self.accumulate
        self.maps = np.zeros(self.nc)
        # the epoch being trained, as in an uninterrupted run (upstream's start_epoch - 1 repeats the learning rate
        # of the resumed epoch in the next one)
        self.scheduler.last_epoch = start.epoch
        self.stopper = EarlyStopping(patience=self.opt.patience)
        self.stopper.best_epoch, self.stopper.best_fitness = start.best_epoch, self.best_fitness

    def fit(self):
        opt = self.opt
        self.callbacks.run('on_train_start')
        LOGGER.info(f'Image sizes {self.imgsz} train, {self.imgsz} val\n'
                    f'{self.world} process(es), batch {self.batch_size} ({self.batch_size // self.world} per process), '
                    f'{self.train_loader.num_workers} dataloader workers per process\n'
                    f"Logging results to {colorstr('bold', self.save_dir)}\n"
                    f'Starting training for {opt.epochs} epochs...')
        t0 = time.time()
        epoch = self.start.epoch - 1
        for epoch in range(self.start.epoch, opt.epochs):
            self.callbacks.run('on_train_epoch_start')
            started = time.time()
            mloss = self.train_epoch(epoch, self.start.step if epoch == self.start.epoch else 0)
            trained = time.time()
            lr = [x['lr'] for x in self.optimizer.param_groups]
            self.scheduler.step()
            stop = self.end_epoch(epoch, mloss, lr)
            memory = self.memory_report()  # a collective: every rank takes part
            LOGGER.info(f'epoch {epoch}: {len(self.dataset)} images in {trained - started:.1f} s '
                        f'({len(self.dataset) / (trained - started):.1f} img/s); validation {self.val_seconds:.1f} s, '
                        f'epoch end {time.time() - trained:.1f} s{memory}')
            if self.pending_signal:  # signalled in the epoch's last steps, after its last optimizer step
                self.interrupt(epoch + 1, 0, mloss)
            if stop:
                break
        LOGGER.info(f'\n{epoch - self.start.epoch + 1} epochs completed in {(time.time() - t0) / 3600:.3f} hours.')
        self.finish(epoch)

    def interrupt(self, epoch, step, mloss):
        """Every rank stops at the same optimizer-step boundary; rank 0 first saves it if --save-on-signal."""
        saved = None
        if self.opt.save_on_signal:
            where = self.position_at(epoch, step, mloss)
            if self.primary:
                self.save(where, fitness_of=None, final_epoch=False)
            saved = self.last
        raise shutdown.Interrupted(self.pending_signal, saved)

    def position_at(self, epoch, step, mloss) -> position.Position:
        """The run's position after step global batches of epoch (a collective mid-epoch: each rank's own
        statistics go with it)."""
        ranks = None
        if 0 < step:  # at an epoch's start the ranks hold the statistics synchronised at the end of the last
            state = position.rank_state(self.raw_model, self.ema.ema, mloss)
            ranks = comm.all_gather_object(position.in_host_memory(state)) if self.world > 1 else [state]
        return position.Position(epoch, step, self.last_opt_step, int(self.accumulate), self.stopper.best_epoch,
                                 len(self.dataset), self.batch_size, ranks)

    def after_step(self, epoch, i, ni, mloss):
        """Signals and periodic checkpoints act at the first optimizer-step boundary (no gradient pending) from
        where every rank learnt of them: all ranks at the same step."""
        signum, timed = self.stop.agreed(ni, self.primary and self.checkpoint_time_passed())
        self.pending_signal = self.pending_signal or signum
        self.checkpoint_pending |= timed
        if self.last_opt_step != ni:
            return
        every = self.opt.checkpoint_steps
        if self.pending_signal:
            self.interrupt(epoch, i + 1, mloss)
        if self.checkpoint_pending or (every and self.ema.updates % every == 0):
            self.save_periodic(self.position_at(epoch, i + 1, mloss))

    def checkpoint_time_passed(self) -> bool:
        minutes = self.opt.checkpoint_minutes
        return bool(minutes) and time.monotonic() - self.last_checkpoint_time >= minutes * 60

    def save_periodic(self, where: position.Position):
        """--checkpoint-steps/--checkpoint-minutes: rank 0 copies the state to host memory here, and writes it off
        the training thread (checkpoint.CheckpointWriter: one write at a time, a due one skipped meanwhile)."""
        self.checkpoint_pending = False
        if not self.primary:
            return
        self.last_checkpoint_time = time.monotonic()
        self.writer.submit(lambda: self.queue_host_checkpoint(where), self.last,
                           f'checkpoint at epoch {where.epoch} step {where.step}',
                           then=lambda: self.record_saved(where))

    def record_saved(self, where: position.Position):
        """run.json: a checkpoint of this position is in place (upstream's epoch: the last complete one)."""
        runs.write_record(self.save_dir, saved_epoch=where.epoch - 1, saved_position=[where.epoch, where.step])

    def close(self):
        """On every way out: stop handling signals and end this rank's loader workers, which would otherwise
        live on (persistent ones until their iterator is garbage-collected, maybe never: issue 11)."""
        self.stop.close()
        self.writer.close()  # a periodic checkpoint under way completes
        failures.end_children()
        gc.unfreeze()  # a process that goes on (a test's) collects the run's objects again

    def memory_report(self) -> str:
        if not self.cuda:
            return ''
        peaks = comm.all_gather_object(torch.cuda.max_memory_reserved(self.device) // 2 ** 20)
        return '; peak reserved MiB per rank ' + ', '.join(map(str, peaks))

    def train_epoch(self, epoch, start_step=0):
        opt, dataset = self.opt, self.dataset
        self.model.train()
        if opt.image_weights:  # one process only (checked in cli)
            class_weights = self.raw_model.class_weights.cpu().numpy() * (1 - self.maps) ** 2 / self.nc
            weights = labels_to_image_weights(dataset.labels, nc=self.nc, class_weights=class_weights)
            dataset.indices = stream.image_weights_draw(opt.seed, epoch).choices(range(dataset.n), weights=weights,
                                                                                 k=dataset.n)
        if epoch == opt.epochs - opt.close_mosaic:
            LOGGER.info('Closing dataloader mosaic')  # the epoch of each sample decides (yolov9_ddp.stream)
        losses = self.task.loss_names
        mloss = torch.zeros(len(losses), device=self.device)
        if start_step:
            mloss = self.resumed_mean_loss.to(self.device)
        columns = ('Epoch', 'GPU_mem', *losses, 'Instances', 'Size')
        LOGGER.info(('\n' + '%11s' * len(columns)) % columns)
        batches = enumerate(self.batches.of_epoch(epoch, start_step), start_step)
        pbar = tqdm(batches, total=self.nb, initial=start_step, bar_format=TQDM_BAR_FORMAT, disable=not self.primary)
        self.zero_grad()
        non_blocking = self.cuda  # page-locked batches (data.make_loader)
        progress = LaggingLosses()
        for i, batch in pbar:
            self.callbacks.run('on_train_batch_start')
            ni = i + self.nb * epoch
            imgs, targets, paths = batch[:3]
            imgs = imgs.to(self.device, non_blocking=non_blocking).float() / 255
            if self.perf.channels_last:
                imgs = imgs.contiguous(memory_format=torch.channels_last)
            loss_items = self.train_step(ni, epoch, imgs, self.loss_targets(targets),
                                         **self.task.loss_inputs(batch, self.device, non_blocking))
            mloss = (mloss * i + loss_items) / (i + 1)
            self.after_step(epoch, i, ni, mloss)
            if self.primary:
                last = i == self.nb - 1
                shown = progress.shown(mloss, last) if i % PROGRESS_EVERY == 0 or last else None
                if shown is not None:
                    mem = f'{torch.cuda.memory_reserved() / 1E9 if torch.cuda.is_available() else 0:.3g}G'
                    pbar.set_description(('%11s' * 2 + '%11.4g' * (len(losses) + 2)) %
                                         (f'{epoch}/{opt.epochs - 1}', mem, *shown, targets.shape[0], imgs.shape[-1]))
                self.callbacks.run('on_train_batch_end', self.raw_model, ni, imgs, targets, paths, list(mloss),
                                   **self.task.plot_inputs(batch))
        return mloss

    def loss_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """The batch's targets as the loss takes them: the loader's (on the host) with dense_box_loss, where the task's
        loss pads them there without waiting for the GPU (patch 0016), else copied to the device."""
        if self.perf.dense_box_loss and self.task.takes_dense_box_loss:
            return targets
        return targets.to(self.device, non_blocking=self.cuda)

    def warmup(self, ni, epoch):
        """Upstream's warmup: accumulation, learning rates and momentum ramp up over the first iterations."""
        x = [0, self.warmup_iters]
        self.accumulate = max(1, np.interp(ni, x, [1, NOMINAL_BATCH / self.batch_size]).round())
        for j, group in enumerate(self.optimizer.param_groups):
            start = self.hyp['warmup_bias_lr'] if j == 0 else 0.0
            group['lr'] = np.interp(ni, x, [start, group['initial_lr'] * self.lf(epoch)])
            if 'momentum' in group:
                group['momentum'] = np.interp(ni, x, [self.hyp['warmup_momentum'], self.hyp['momentum']])

    def train_step(self, ni, epoch, imgs, targets, **loss_inputs):
        """Forward, backward and (every `accumulate` images) an optimizer step; returns the loss items.
        loss_inputs: what the task's loss takes besides the targets (segmentation: the masks)."""
        opt = self.opt
        if ni <= self.warmup_iters:
            self.warmup(ni, epoch)
        if opt.multi_scale:
            imgs = self.rescale(imgs, ni)
        steps = ni - self.last_opt_step >= self.accumulate
        # micro-steps that do not step skip DDP's gradient all-reduce; the stepping one reduces the sum
        sync = nullcontext() if steps or self.world == 1 else self.model.no_sync()
        with sync:
            with torch.amp.autocast('cuda', enabled=self.amp, cache_enabled=not self.perf.cuda_graphs):
                pred = self.forward(imgs)
                loss, loss_items = self.compute_loss(pred, targets, **loss_inputs)
                loss *= self.world  # DDP averages gradients over ranks; upstream's loss is a sum over the batch
                if opt.quad:
                    loss *= 4.
            self.scaler.scale(loss).backward()
        if steps:
            self.optimizer_step()
            self.last_opt_step = ni
        return loss_items

    def optimizer_step(self):
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=10.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.zero_grad()
        self.update_ema(self.model)

    def zero_grad(self):
        """Before the next optimizer step's micro-steps. Under cuda_graphs the gradients are zeroed in place, so that
        backward adds into them and needs no clone (graphs.GraphedModel)."""
        self.optimizer.zero_grad(set_to_none=not self.perf.cuda_graphs)
        if self.perf.cuda_graphs:
            self.forward.resident()

    def rescale(self, imgs, ni):
        """--multi-scale: the size of step ni, the same on every rank and in every start (yolov9_ddp.stream)."""
        gs = max(int(self.raw_model.stride.max()), 32)
        sizes = range(int(self.imgsz * 0.5), int(self.imgsz * 1.5) + gs)
        size = stream.scale_draw(self.opt.seed, ni).choice(sizes) // gs * gs
        factor = size / max(imgs.shape[2:])
        if factor == 1:
            return imgs
        shape = [math.ceil(x * factor / gs) * gs for x in imgs.shape[2:]]
        return nn.functional.interpolate(imgs, size=shape, mode='bilinear', align_corners=False)

    def end_epoch(self, epoch, mloss, lr):
        """Synchronise the EMA, validate, track the best fitness, save; returns whether to stop early."""
        opt = self.opt
        self.callbacks.run('on_train_epoch_end', epoch=epoch)
        synchronize_ema(self.ema, self.raw_model)
        self.ema.update_attr(self.raw_model, include=['yaml', 'nc', 'hyp', 'names', 'stride', 'class_weights'])
        final_epoch = epoch + 1 == opt.epochs or self.stopper.possible_stop
        started = time.time()
        if not opt.noval or final_epoch:
            self.results, self.maps, _ = self.validate(self.ema.ema, plots=False)
        self.val_seconds = time.time() - started
        fi = self.task.fitness(self.results)
        stop = self.stopper(epoch=epoch, fitness=fi)  # the same results on every rank: the same decision
        if fi > self.best_fitness:
            self.best_fitness = fi
        self.callbacks.run('on_fit_epoch_end', list(mloss) + list(self.results) + lr, epoch, self.best_fitness, fi)
        if self.primary and (not opt.nosave or final_epoch):
            self.save(self.position_at(epoch + 1, 0, mloss), fi, final_epoch)
        return stop

    def validate(self, model, plots, compute_loss=True):
        """Every rank validates its shard; the task's validation run() gathers the statistics (patched upstream:
        distributed=True), so all ranks get the same metrics, those of one process over the whole set."""
        return self.task.validate(data=self.data_dict, batch_size=self.batch_size // self.world * 2,
                                  imgsz=self.imgsz, half=self.amp, model=model, single_cls=self.opt.single_cls,
                                  dataloader=self.val_loader, save_dir=self.save_dir, plots=plots and self.primary,
                                  verbose=plots, callbacks=self.callbacks,
                                  compute_loss=self.compute_loss if compute_loss else None,
                                  distributed=self.world > 1, **self.task.validation_options(self.opt))

    def save(self, where: position.Position, fitness_of, final_epoch):
        """Rank 0: everything a resume needs, written atomically (yolov9_ddp.checkpoint.save_atomic).

        fitness_of is this epoch's fitness; None for a position inside an epoch, which is never best.pt.
        """
        epoch = where.epoch - 1  # upstream's: the last complete epoch
        self.writer.wait()  # a periodic checkpoint under way: never two writers of last.pt
        self.last_checkpoint_time = time.monotonic()
        checkpoint.save_atomic(self.queue_host_checkpoint(where)(), self.last, keep_previous=True)
        self.record_saved(where)
        if fitness_of is not None and self.best_fitness == fitness_of:
            checkpoint.copy_atomic(self.last, self.best)
        if fitness_of is not None and self.opt.save_period > 0 and epoch % self.opt.save_period == 0:
            checkpoint.copy_atomic(self.last, self.weights_dir / f'epoch{epoch}.pt')
        self.callbacks.run('on_model_save', self.last, epoch, final_epoch, self.best_fitness, fitness_of)

    def queue_host_checkpoint(self, where: position.Position):
        """Upstream's checkpoint (its scripts read ours) with the grad scaler, the world size and the position, as a
        copy in host memory queued here, which calling completes (checkpoint.QueuedCheckpoint: in the writer's thread
        or process for a periodic checkpoint)."""
        return checkpoint.QueuedCheckpoint(self.checkpoint_of(where))

    def checkpoint_of(self, where: position.Position) -> dict:
        return {
            'epoch': where.epoch - 1,
            'best_fitness': self.best_fitness,
            'model': self.raw_model,
            'ema': self.ema.ema,
            'updates': self.ema.updates,
            'optimizer': self.optimizer.state_dict(),
            'scaler': checkpoint.scaler_state(self.scaler),
            'world_size': self.world,  # a resume on another number of processes says what that changes
            position.KEY: position.record(where),
            'opt': self.recorded_options(),
            'git': None,
            'date': datetime.now().isoformat(),
            'format': checkpoint.FORMAT}

    def finish(self, epoch):
        """Strip the checkpoints (rank 0), validate best.pt on all ranks with plots, report the mAP."""
        self.writer.wait()
        if self.primary:
            self.strip_final_checkpoints()
            # only now is the run finished: a restart before this line resumes from last.previous.pt
            runs.write_record(self.save_dir, finished=True)
            checkpoint.previous_path(self.last).unlink(missing_ok=True)
        if comm.broadcast_object(self.best.exists()):
            best = load_everywhere(lambda: checkpoint.load_checkpoint(self.best))
            model = best['model'].to(self.device).float().fuse().eval()
            LOGGER.info(f'\nValidating {self.best}...')
            self.results, _, _ = self.validate(model.half() if self.amp else model, plots=not self.opt.noplots)
        self.callbacks.run('on_train_end', self.last, self.best, epoch, self.results)
        LOGGER.info(f'{colorstr("bold", "Final:")} {self.task.summary(self.results)}  ({self.best})')

    def strip_final_checkpoints(self):
        """Upstream's stripped last.pt and best.pt; where best.pt is the last epoch's checkpoint (the same bytes,
        copy_atomic), its stripped file is a copy of last.pt's, not loaded and stripped again."""
        best_is_last = self.last.exists() and self.best.exists() and filecmp.cmp(self.last, self.best, shallow=False)
        if self.last.exists():
            strip_atomically(self.last, self.task.stripped(self.last))
        if best_is_last:
            checkpoint.copy_atomic(self.task.stripped(self.last), self.task.stripped(self.best))
            log_stripped(self.best, self.task.stripped(self.best))
        elif self.best.exists():
            strip_atomically(self.best, self.task.stripped(self.best))


def freeze_long_lived_objects():
    """Collect, then move every object alive now (torch's and upstream's modules, the model, the dataset's labels:
    470,000 in a small run on CPUs) to the garbage collector's permanent generation. A full collection, which a
    checkpoint's copy (two model objects, tens of thousands of new objects) sets off, then visits only what was
    made since: 0.29 s -> 0.01 s on CPUs, every thread of the process waiting meanwhile (bench/RESULTS.md); and the
    loader workers, forked next, do not write to the pages of those objects when they collect (Python's gc.freeze
    documentation)."""
    gc.collect()
    gc.freeze()


def prepare_trainer(task, opt, device, plan):
    """Everything before the first epoch, inside the process group: a set-up Trainer, or None if done already.
    plan: plan_start()'s, made before the group."""
    if comm.is_primary():  # as upstream's print_args(), which would name this module instead of the entry point
        options = ', '.join(f'{k}={v}' for k, v in vars(opt).items())
        LOGGER.info(colorstr(f'{Path(task.script).with_suffix("")}: ') + options)
        slurm.warn_if_requeued_without_resume(opt, LOGGER.warning)
    opt.data = resolve_data(task, opt)  # a resume has the run's --data already: no demo dataset is made
    create_run(plan)
    LOGGER.info(plan.reason)
    if plan.finished:
        return None
    if plan.resume_from is None:
        resolve_model_files(opt)
    opt.save_dir = str(plan.save_dir)
    trainer = Trainer(task, opt, device, plan)
    try:
        trainer.setup()
    except BaseException:
        trainer.close()  # its signal handlers and loader workers: torchrun's SIGTERM must end this process
        raise
    return trainer


def train(task, opt, device, plan):
    trainer = prepare_trainer(task, opt, device, plan)
    if trainer is None:
        return
    try:
        trainer.fit()
    finally:
        trainer.close()
