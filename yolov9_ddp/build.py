"""Everything before the first step: the run's folder and options (plan_start, before the process group), then the
model, the optimizer, the loaders and the resumed state (build, inside it), handed to a Trainer with its parts.
No loop in here.
"""
import gc
import inspect
import logging
from dataclasses import replace
from importlib import import_module
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.optim import lr_scheduler

from utils.autobatch import check_train_batch_size
from utils.callbacks import Callbacks
from utils.general import (LOGGER, check_dataset, check_img_size, check_yaml, colorstr, get_latest_run,
                           increment_path, init_seeds, intersect_dicts, labels_to_class_weights, methods, one_cycle,
                           one_flat_cycle, yaml_save)
from utils.torch_utils import EarlyStopping, ModelEMA, smart_optimizer
from yolov9_ddp import cli, comm, data, experiment, extend, graphs, parts, perf, runs, slurm
from yolov9_ddp.checkpoints import Checkpoints, ModelMismatch, load_checkpoint, load_everywhere, load_for_resume
from yolov9_ddp.files import atomic_write, remove_stale_temporaries
from yolov9_ddp.demo_data import ensure_demo_dataset
from yolov9_ddp.ema import EmaUpdater
from yolov9_ddp.state import RunState, restore_rank_state
from yolov9_ddp.trainer import NOMINAL_BATCH, Trainer
from yolov9_ddp.writer import WriterProcess


# -- the start: before the process group ---------------------------------------------------------------------------

def configure_logging():
    """Rank 0 logs as upstream; other ranks keep warnings and errors only, prefixed with their rank."""
    rank = comm.launched_rank()  # also before the process group exists
    if rank == 0:
        return
    LOGGER.setLevel(logging.WARNING)
    for handler in LOGGER.handlers:  # upstream's set_logging() gave them level ERROR on ranks other than 0
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter(f'[rank {rank}] %(message)s'))


def plan_start(opt, given: dict = None, say=LOGGER.info) -> runs.RunPlan:
    """Rank 0 decides the run, every rank learns it, and a resume takes the run's own options, so that the checks and
    the device of every rank are the run's, not the command line's defaults. given: the flags the command line gives
    (cli.given_flags); say: what takes the resume's lines about them."""
    configure_logging()
    plan = comm.rank0_decides(lambda: plan_run(opt), opt.ddp_timeout)
    if plan.resume_from is not None:
        restore_resumed_options(opt, plan, given or {}, say)
    return plan


def plan_run(opt) -> runs.RunPlan:
    """The run folder (runs.plan_run) and, for a resume, the run's saved options: rank 0 reads them."""
    plan = runs.plan_run(opt, get_latest_run, increment_path)
    return plan if plan.resume_from is None else replace(plan, options=runs.saved_options(plan))


def restore_resumed_options(opt, plan, given: dict, say):
    """On resume, take the run's saved options (as upstream), this start's own where its command line gives them
    (runs.py); one line names the given flags that the run's own values overrule. --deterministic, once set, is
    kept, and a resume may set it."""
    overruled = runs.overruled_flags(vars(opt), plan.options, given)
    resumed = runs.resumed_options(vars(opt), plan.options, given)
    resumed['deterministic'] = opt.deterministic or bool(plan.options.get('deterministic'))
    try:
        given_switches = perf.requested({**vars(opt), 'deterministic': resumed['deterministic']})
    except ValueError as e:
        raise cli.UsageError(f'{e} (the run in {plan.save_dir} is deterministic)') from e
    vars(opt).update(resumed)
    opt.levers = perf.resumed(plan.options, given_switches, opt, comm.launched_world_size(), say)
    opt.resume, opt.weights = True, str(plan.resume_from)
    if opt.cfg and not Path(opt.cfg).is_file():  # a relative path from another folder: the checkpoint's own yaml
        opt.cfg = ''
    if overruled and comm.launched_rank() == 0:
        say(f"WARNING: a resumed run keeps its own options (opt.yaml), so these flags are ignored: "
            f"{', '.join(overruled)}")


# -- the run: inside the process group -----------------------------------------------------------------------------

def prepare(task, opt, device, plan, extra_parts=()):
    """A Trainer ready for its first step, or None where the run has finished already. extra_parts: called before
    the run's own at every point (a test's faults)."""
    if comm.is_primary():  # as upstream's print_args(), which would name this module instead of the entry point
        LOGGER.info(colorstr(f'{Path(task.script).with_suffix("")}: ') + ', '.join(f'{k}={v}' for k, v in
                                                                                  vars(opt).items()))
        slurm.warn_if_requeued_without_resume(opt, LOGGER.warning)
    opt.data = resolve_data(task, opt)  # a resume has the run's --data already: no demo dataset is made
    create_run(plan)
    LOGGER.info(plan.reason)
    if plan.finished:
        return None
    if plan.resume_from is None:
        resolve_model_files(opt)
    opt.save_dir = str(plan.save_dir)
    cuda = device.type == 'cuda'
    run_parts = [*extra_parts, *parts.standard(opt, cuda)]
    checkpoints = Checkpoints(LOGGER.warning, WriterProcess(LOGGER.warning)) if comm.is_primary() else None
    try:
        if checkpoints is not None:
            import_module(task.model_module)  # whose classes the writer, forked next, unpickles
            checkpoints.start_process()  # forked now, while this process is small
        return Trainer(run_parts, **build(task, opt, device, plan, checkpoints))
    except BaseException:
        for part in run_parts:  # their signal handlers: torchrun's SIGTERM must end this process
            part.close(None)
        if checkpoints is not None:
            checkpoints.close()
        raise


def build(task, opt, device, plan, checkpoints) -> dict:
    """What the Trainer trains with, as its attributes."""
    rank, world, cuda = comm.get_rank(), comm.get_world_size(), device.type == 'cuda'
    primary, save_dir = rank == 0, plan.save_dir
    chosen = perf.for_run(opt, world, task)  # into opt.yaml and the checkpoints
    hyp = load_hyp(opt)
    callbacks = Callbacks()  # actions registered on rank 0 only: other ranks log nothing
    if primary:
        yaml_save(save_dir / 'hyp.yaml', hyp)
        save_options(opt)
        continued = experiment.logged_before(save_dir)
        experiment.continue_wandb_run(save_dir)
        loggers = task.loggers(save_dir, opt, hyp, LOGGER)
        for action in methods(loggers):
            callbacks.register_action(action, callback=getattr(loggers, action))
    callbacks.run('on_pretrain_routine_start')
    init_seeds(opt.seed + 1 + rank)
    said = perf.apply_to_torch(chosen, opt.seed + 1 + rank, opt.deterministic)
    if said:
        LOGGER.info(said)
    data_dict = comm.run_staged(lambda: check_data(opt))  # may download: rank 0 first
    nc = 1 if opt.single_cls else int(data_dict['nc'])
    names = {0: 'item'} if opt.single_cls and len(data_dict['names']) != 1 else data_dict['names']
    extending = extend.new_total(opt, plan)  # the run's total of epochs that --epochs changes, or None
    ckpt = load_everywhere(lambda: initial_checkpoint(opt, extending is not None)) if opt.weights.endswith('.pt') \
        else None
    stripped = ckpt is not None and opt.resume and ckpt.get('optimizer') is None
    model = build_model(task, opt, hyp, nc, ckpt, device, chosen)
    amp = cuda  # upstream's check_amp() passes on every CUDA device
    gs = max(int(model.stride.max()), 32)
    imgsz = check_img_size(opt.imgsz, gs, floor=gs * 2)
    batch_size = resolve_batch_size(opt, model, imgsz, amp, callbacks)
    accumulate = max(round(NOMINAL_BATCH / batch_size), 1)
    hyp['weight_decay'] *= batch_size * accumulate / NOMINAL_BATCH
    optimizer = smart_optimizer(model, opt.optimizer, hyp['lr0'], hyp['momentum'], hyp['weight_decay'])
    if cuda and chosen.fused_optimizer and opt.optimizer != 'LION':
        optimizer = perf.fused(optimizer)
    lf = learning_rate_factor(opt, hyp)
    scheduler = lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    per_rank = batch_size // world
    train_loader, dataset = data.train_loader(task, data_dict['train'], imgsz, per_rank, gs, opt, hyp, cuda,
                                              colorstr('train: '))
    nb = train_loader.batch_sampler.steps  # global batches per epoch
    labels = np.concatenate(dataset.labels, 0)
    max_class = int(labels[:, 0].max()) if len(labels) else -1
    if max_class >= nc:
        raise cli.UsageError(f'label class {max_class} exceeds nc={nc} in {opt.data}; '
                             f'possible class labels are 0-{nc - 1}')
    val_loader = data.val_loader(task, data_dict['val'], imgsz, per_rank * 2, gs, opt, cuda, colorstr('val: '))
    if not opt.resume:
        model.half().float()  # pre-reduce anchor precision, as train_dual.py
    if primary:
        callbacks.run('on_pretrain_routine_end', labels, names)
    model.nc, model.hyp, model.names = nc, hyp, names
    model.class_weights = labels_to_class_weights(dataset.labels, nc).to(device) * nc
    raw_model, ddp_model = wrap(model, opt, device, world)  # DDP makes every rank's weights rank 0's
    ema = ModelEMA(raw_model)  # after DDP's broadcast, so the EMA starts identical on every rank
    scaler = torch.amp.GradScaler('cuda', enabled=amp)
    run = RunState(scaler, ema, EarlyStopping(patience=opt.patience), len(dataset), batch_size, world, accumulate)
    resumed_mean_loss = restore(ckpt, opt, optimizer, ema, run, raw_model, nb) if ckpt and opt.resume else None
    del ckpt
    if primary:
        experiment.continue_results_csv(save_dir, run.epoch)
    if primary and continued:
        experiment.continue_tensorboard(loggers, save_dir, run.epoch)
    if extending is not None:
        extend.begin(opt, run, extending, stripped, LOGGER.info)
        if primary:
            save_options(opt)
    scheduler.last_epoch = run.epoch  # the epoch being trained (upstream's start_epoch - 1 repeats a learning rate)
    freeze_long_lived_objects()
    return dict(task=task, opt=opt, device=device, cuda=cuda, rank=rank, world=world, primary=primary,
                save_dir=save_dir, weights_dir=save_dir / 'weights', perf=chosen, hyp=hyp, callbacks=callbacks,
                data_dict=data_dict, nc=nc, names=names, imgsz=imgsz, batch_size=batch_size, amp=amp,
                model=ddp_model, raw_model=raw_model,
                forward=graphs.GraphedModel(ddp_model, log=LOGGER.warning) if chosen.cuda_graphs else ddp_model,
                optimizer=optimizer, lf=lf, scheduler=scheduler, ema=ema, update_ema=EmaUpdater(ema, raw_model),
                scaler=scaler, compute_loss=task.loss(raw_model, opt, chosen), train_loader=train_loader,
                batches=data.TrainingBatches(train_loader, opt.epochs), dataset=dataset, nb=nb,
                val_loader=val_loader, warmup_iters=max(round(hyp['warmup_epochs'] * nb), 100), maps=np.zeros(nc),
                state=run, resumed_mean_loss=resumed_mean_loss, checkpoints=checkpoints)


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


def create_run(plan: runs.RunPlan):
    """Rank 0 creates the run folder and records the start (nothing is written before the checks pass)."""
    error = None
    if comm.is_primary() and not plan.finished:
        try:
            runs.start_record(plan)
            remove_stale_temporaries(plan.save_dir / 'weights')  # of a writer killed mid-save
        except (OSError, runs.RunBusy) as e:
            error = e
    comm.raise_if_any_failed(error)


def load_hyp(opt) -> dict:
    hyp = opt.hyp if isinstance(opt.hyp, dict) else yaml.safe_load(Path(opt.hyp).read_text())
    hyp['anchor_t'] = 5.0  # as train_dual.py
    hyp['label_smoothing'] = opt.label_smoothing
    LOGGER.info(colorstr('hyperparameters: ') + ', '.join(f'{k}={v}' for k, v in hyp.items()))
    opt.hyp = hyp.copy()
    return hyp


def save_options(opt):
    """The run's opt.yaml, in one rename: a resume on another rank may read it meanwhile."""
    options = yaml.safe_dump({k: str(v) if isinstance(v, Path) else v for k, v in vars(opt).items()
                              if k != 'save_dir'}, sort_keys=False)
    atomic_write(Path(opt.save_dir) / 'opt.yaml', lambda f: f.write(options.encode()))


def check_data(opt):
    try:
        return check_dataset(opt.data)
    except Exception as e:  # upstream reports a bad data yaml with assertions and bare exceptions
        raise cli.UsageError(f'--data {opt.data}: {e}') from e


def initial_checkpoint(opt, extending: bool):
    path = Path(opt.weights)
    if not opt.resume:
        return load_checkpoint(path)
    ckpt, source = load_for_resume(path, LOGGER.warning, stripped_ok=extending)
    opt.weights = str(source)
    return ckpt


def build_model(task, opt, hyp, nc, ckpt, device, chosen):
    cfg = opt.cfg or ckpt['model'].yaml
    wrong = task.wrong_entry_point(cli.head_of(cfg))
    if wrong:
        raise cli.UsageError(wrong)
    model = task.model(cfg, nc, hyp).to(device)
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
    if chosen.channels_last:  # before the optimizer: fused SGD needs its buffers in the weights' layout
        model.to(memory_format=torch.channels_last)
    return model


def load_exactly(model, saved, source):
    """A resume continues the same model: every tensor must match, or the checkpoint belongs to another model."""
    try:
        model.load_state_dict(saved.float().state_dict(), strict=True)
    except RuntimeError as e:
        detail = ' '.join(str(e).split())[:300]
        raise ModelMismatch(f'{source} holds another model than this run ({detail})') from e


def resolve_batch_size(opt, model, imgsz, amp, callbacks) -> int:
    """--batch-size, or AutoBatch's choice for -1, recorded as the run's batch (opt.yaml, checkpoints): a resume or a
    restart keeps it instead of sizing again, which may choose another batch on another GPU or with other free memory,
    and the run could not go on at its step (state.PositionMismatch)."""
    if opt.batch_size != -1:
        return opt.batch_size
    batch = autobatch(model, imgsz, amp)  # one process only (checked in cli)
    callbacks.run('on_params_update', {'batch_size': batch})
    opt.batch_size = batch
    if comm.is_primary():
        save_options(opt)
    return batch


def autobatch(model, imgsz: int, amp: bool) -> int:
    """AutoBatch's batch (upstream's check_train_batch_size), measured with cudnn.benchmark off: upstream's
    autobatch() answers its default, 16, without measuring while benchmark is on (its workspaces would distort the
    memory profile, ultralytics/yolov5#9287), and benchmark is on by default here. It aims at 80% of the free memory,
    which leaves the rest to the benchmark's workspaces."""
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        return check_train_batch_size(model, imgsz, amp)
    finally:
        torch.backends.cudnn.benchmark = benchmark


def learning_rate_factor(opt, hyp):
    """The learning rate's factor of an epoch, by upstream's schedules."""
    if opt.cos_lr:
        return one_cycle(1, hyp['lrf'], opt.epochs)
    if getattr(opt, 'flat_cos_lr', False):  # flags train_triple.py and the segment scripts lack
        return one_flat_cycle(1, hyp['lrf'], opt.epochs)
    if getattr(opt, 'fixed_lr', False):
        return lambda x: 1.0
    return lambda x: (1 - x / opt.epochs) * (1.0 - hyp['lrf']) + hyp['lrf']


def wrap(model, opt, device, world: int) -> tuple:
    """(the model, the module that trains it): DistributedDataParallel on more processes, with gradients as views of
    its buckets (no copy) and each rank's BatchNorm statistics its own between epochs (ema.py)."""
    if world == 1:
        return model, model
    if opt.sync_bn and device.type == 'cuda':
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
        LOGGER.info('Using SyncBatchNorm()')
    return model, DistributedDataParallel(model, device_ids=[device.index] if device.type == 'cuda' else None,
                                          gradient_as_bucket_view=True, **rank_local_buffers())


def rank_local_buffers() -> dict:
    """torch >= 2.14 renamed broadcast_buffers to forward_sync_buffers."""
    if 'forward_sync_buffers' in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {'forward_sync_buffers': False}
    return {'broadcast_buffers': False}


def restore(ckpt, opt, optimizer, ema, run: RunState, model, steps_per_epoch: int):
    """Continue a run: the optimizer, the EMA, the run's state and, where it stopped mid-epoch, each rank's own
    statistics; returns this rank's mean loss there (None at an epoch's start)."""
    if ckpt.get('optimizer') is not None:  # else a finished run's, stripped: a new optimizer state (extend.py)
        optimizer.load_state_dict(ckpt['optimizer'])
    ema.ema.load_state_dict((ckpt['ema'] or ckpt['model']).float().state_dict())
    run.load_state_dict(ckpt, opt.weights)
    mean_loss = restore_rank_state(run.ranks, comm.get_rank(), run.world, model, ema.ema) if run.ranks else None
    LOGGER.info(run.describe(steps_per_epoch, opt.weights) + f' ({opt.epochs} epochs)')
    previous_world = ckpt.get('world_size')
    if comm.is_primary() and previous_world not in (None, run.world) and not (opt.sync_bn and
                                                                              next(model.parameters()).is_cuda):
        # without SyncBatchNorm each process normalises its own images: the run's statistics change
        per_rank = run.global_batch // run.world
        LOGGER.warning(f'WARNING: the run continues on {run.world} process(es) instead of {previous_world}: '
                       f'BatchNorm statistics now come from {per_rank} images per process, not '
                       f'{run.global_batch // previous_world}')
    return mean_loss


def freeze_long_lived_objects():
    """Collect, then move every object alive now (torch's and upstream's modules, the model, the dataset's labels) to
    the garbage collector's permanent generation: a full collection, which a checkpoint's copy sets off, then visits
    only what was made since, every thread of the process waiting meanwhile; and the loader workers, forked next, do
    not write to the pages of those objects when they collect (Python's gc.freeze documentation)."""
    gc.collect()
    gc.freeze()


def train(task, opt, device, plan, extra_parts=()):
    trainer = prepare(task, opt, device, plan, extra_parts)
    if trainer is None:
        return
    try:
        trainer.fit()
    finally:
        trainer.close()
