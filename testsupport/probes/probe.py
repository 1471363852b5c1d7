"""Probes run inside a patched YOLOv9 tree, one process or one per torchrun rank, that drive the real
yolov9_ddp.trainer.Trainer of a task (built by yolov9_ddp.build) and report what each rank saw as JSON (written by
rank 0).

    python probe.py MODES OUT.json TRAIN_ARGS...         (cwd: the patched tree; PROBE_CONFIG: JSON options,
                                                           'task' among them: a task of yolov9_ddp.tasks)

MODES is one probe or several, comma-separated, run in that order on one trainer: one job serves every proof that
can share it. OUT.json: {'world': W, 'ranks': [{mode: what the rank observed, ...}, ...]}.
"""
import gc
import hashlib
import json
import os
import sys
from importlib import import_module
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the kit's testsupport (its yolov9_ddp: the tree's)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from testsupport import imagecache  # noqa: E402
from utils.dataloaders import LoadImagesAndLabels  # noqa: E402
from yolov9_ddp import build, cli, comm, data, failures  # noqa: E402
from yolov9_ddp.tasks import TASKS  # noqa: E402

CONFIG = json.loads(os.environ.get('PROBE_CONFIG') or '{}')
TASK = TASKS[CONFIG.get('task', 'detect-dual')]


def state_hash(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def first_norm(module: nn.Module) -> nn.Module:
    return next(m for m in module.modules() if isinstance(m, nn.BatchNorm2d))


# -- probes: each takes a set-up Trainer and returns what this rank observed ------------------------------------------

def probe_sampler(trainer):
    """The image paths this rank's training loader yields, per epoch."""
    frozen, tracked = gc.get_freeze_count(), len(gc.get_objects())  # the garbage collector's, after the set-up
    count = CONFIG.get('epochs', 3)
    batches = data.TrainingBatches(trainer.train_loader, count)
    epochs = [[p for batch in batches.of_epoch(epoch) for p in batch[2]] for epoch in range(count)]
    return {'epochs': epochs, 'objects': {'frozen': frozen, 'tracked': tracked}, 'cache_builds': BUILDS,
            'files': list(trainer.dataset.im_files)}


def probe_fit(trainer):
    """The task's tiny model fitted to the validation images of the job's data (distributed_val.fit: weights that
    find something there on any machine), saved to CONFIG['weights'] for the probes that follow and for the task's
    other jobs: the reference job of one process fits, in the process that it starts anyway."""
    import distributed_val
    weights = Path(CONFIG['weights'])
    part = weights.with_suffix('.part')
    distributed_val.fit(TASK.name, CONFIG['cfg'], trainer.opt.data, part)
    part.replace(weights)  # a fit killed half way is never taken for a whole one
    return {'weights': str(weights)}


def probe_steps(trainer):
    """Optimizer steps on fixed global batches, each from the same fixed weights (CONFIG['weights']), with
    BatchNorm statistics frozen.

    CONFIG['steps'] = {name: {'indices': [...], 'micro': M}}: the global batch is those indices of the validation
    dataset (letterboxed, not augmented: the same images and labels, masks too, on every rank), cut into M
    micro-batches, contiguous runs of them per rank; each rank accumulates its share, so one process with M
    micro-batches and W processes with M/W each take the same optimizer step. BatchNorm layers run in eval mode:
    in train mode a layer normalises with the statistics of the rank's own images, which no real DDP run (without
    SyncBatchNorm) shares either. The trainer's own state is restored afterwards, for the probes that follow. The
    parameters after each step go to OUT.params-rankR.pt ({name: {parameter: float64 tensor}}), named in the report.
    """
    run = trainer.state
    kept = run.accumulate, run.last_opt_step, trainer.warmup_iters
    init = torch.load(CONFIG['weights'], map_location='cpu', weights_only=False)['model'].float().state_dict()
    observed = {name: one_step(trainer, init, step['indices'], step['micro']) for name, step in CONFIG['steps'].items()}
    run.accumulate, run.last_opt_step, trainer.warmup_iters = kept
    trainer.optimizer.state.clear()
    params = OUT.with_name(f'{OUT.stem}.params-rank{trainer.rank}.pt')  # a binary file: JSON took seconds a job
    torch.save({name: step.pop('params') for name, step in observed.items()}, params)
    return {name: {**step, 'params': str(params)} for name, step in observed.items()}


def one_step(trainer, init: dict, indices: list, micro: int) -> dict:
    model, task = trainer.raw_model, trainer.task
    model.load_state_dict(init)
    trainer.optimizer.state.clear()  # no momentum from an earlier step
    trainer.optimizer.zero_grad()
    trainer.model.train()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    dataset, collate = trainer.val_loader.dataset, task.collate(quad=False)
    world, rank = trainer.world, trainer.rank
    per_rank, size = micro // world, len(indices) // micro
    trainer.state.accumulate, trainer.state.last_opt_step, trainer.warmup_iters = per_rank, -1, -1
    grads_after_first = None
    for step in range(per_rank):
        first = (rank * per_rank + step) * size
        batch = collate([dataset[i] for i in indices[first:first + size]])
        trainer.train_step(step, 0, batch[0].float() / 255, batch[1],
                           **task.loss_inputs(batch, trainer.device, non_blocking=False))
        if step == 0 and per_rank > 1:
            grads_after_first = [p.grad.detach().double().sum().item() for p in model.parameters()
                                 if p.grad is not None][:8]
    params = {k: v.detach().cpu().double() for k, v in model.state_dict().items() if v.dtype.is_floating_point}
    return {'params': params,
            'moved': max(float((v - init[k].double()).abs().max()) for k, v in params.items()),
            'grads_after_first_micro_step': grads_after_first}


def probe_ema(trainer):
    """EMA and BatchNorm statistics around each epoch's end (parts/epoch_end.py), where they are synchronised."""
    seen = []
    for epoch in range(trainer.opt.epochs):
        trainer.train_epoch(epoch)
        trainer.trained_s, trainer.lr = 1.0, [g['lr'] for g in trainer.optimizer.param_groups]
        before = first_norm(trainer.raw_model).running_mean.tolist()
        trainer.call('after_epoch', epoch)
        seen.append({'ema_hash': state_hash(trainer.ema.ema), 'bn_before': before,
                     'bn_after': first_norm(trainer.raw_model).running_mean.tolist(),
                     'ema_updates': trainer.ema.updates})
    return {'epochs': seen}


def probe_val(trainer):
    """Distributed validation of fixed weights: every rank's metrics and image count."""
    from models.experimental import attempt_load
    model = attempt_load(CONFIG['weights'], trainer.device)
    results, maps, _ = trainer.validate(model, plots=False, compute_loss=False)
    observed = {'results': [float(x) for x in results], 'maps': [float(x) for x in maps],
                'shard_batches': len(trainer.val_loader)}
    if trainer.world == 1:  # the reference: upstream's own validation path, its dataloader included
        observed['upstream_results'] = upstream_validation(trainer, model)
    return observed


def upstream_validation(trainer, model):
    """The task's upstream validation over upstream's own dataloader, in one process, as its training script
    builds them (the segment scripts: utils.segment.dataloaders, with the mask options)."""
    opt = trainer.opt
    loaders = import_module('utils.segment.dataloaders' if TASK.masks else 'utils.dataloaders')
    masks = {'mask_downsample_ratio': opt.mask_ratio, 'overlap_mask': not opt.no_overlap} if TASK.masks else {}
    batch = trainer.batch_size * 2
    loader = loaders.create_dataloader(trainer.data_dict['val'], trainer.imgsz, batch, int(model.stride.max()),
                                       pad=0.5, rect=True, workers=0, **masks)[0]
    results, _, _ = TASK.validate(data=trainer.data_dict, batch_size=batch, imgsz=trainer.imgsz, model=model,
                                  dataloader=loader, half=False, plots=False, **TASK.validation_options(opt))
    return [float(x) for x in results]


def probe_upstream_val(trainer):
    """Upstream's own validation script of the task with distributed=True (patch 0009), on this rank's shard,
    outside the kit's trainer: testsupport/probes/distributed_val.py, with CONFIG['upstream_val_batch']."""
    import distributed_val
    return distributed_val.validate_shard(TASK.name, CONFIG['weights'], trainer.opt.data, trainer.save_dir,
                                          CONFIG['upstream_val_batch'], trainer.rank, trainer.world)


def job_root() -> int:
    """The job's first process: torchrun's agent, or this process when it runs alone."""
    return os.getppid() if 'TORCHELASTIC_RUN_ID' in os.environ else os.getpid()


def probe_ramcache(trainer):
    """--cache ram: what this rank decoded, the images it sees, and (rank 0, once every loader worker of every
    rank has loaded a batch) which of the job's processes map the shared cache and what it costs the node."""
    decoded = len(DECODES)
    loaders = {'train': trainer.train_loader, 'val': trainer.val_loader}
    datasets = {'train': trainer.dataset, 'val': trainer.val_loader.dataset}  # the training loader's wraps it
    observed = {'decodes': decoded, 'pid': os.getpid(),
                'images': {name: type(d.ims).__name__ for name, d in datasets.items()},
                'digests': {name: imagecache.images_digest(d.ims, d.im_hw0, d.im_hw) for name, d in datasets.items()}}
    for loader in loaders.values():
        next(iter(loader))  # starts the loader's (persistent) workers, which load and augment cached images
    observed['workers'] = [w.pid for loader in loaders.values() for w in getattr(loader._iterator, '_workers', [])]
    comm.barrier()
    if comm.is_primary():
        observed['node'] = imagecache.node_cache_report(imagecache.descendants(job_root()))
    comm.barrier()  # no rank leaves, taking its workers along, before rank 0 has measured
    observed['decodes_after_setup'] = len(DECODES) - decoded
    return observed


PROBES = {'fit': probe_fit, 'sampler': probe_sampler, 'steps': probe_steps, 'ema': probe_ema, 'val': probe_val,
          'upstream_val': probe_upstream_val, 'ramcache': probe_ramcache}
BUILDS = []  # (rank, cache path) of every label-cache build in this process
DECODES = []  # indices of the images this process decoded (upstream's load_image of an image not cached)


def count_cache_builds():
    original = LoadImagesAndLabels.cache_labels

    def counting(self, path, prefix=''):
        BUILDS.append([comm.get_rank(), str(path)])
        return original(self, path, prefix)

    LoadImagesAndLabels.cache_labels = counting


def count_decodes():
    original = LoadImagesAndLabels.load_image

    def counting(self, i):
        if self.ims[i] is None:
            DECODES.append(i)
        return original(self, i)

    LoadImagesAndLabels.load_image = counting


OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else None  # the report; files beside it hold what JSON holds badly


def main():
    modes, out, argv = sys.argv[1].split(','), OUT, sys.argv[3:]
    if CONFIG.get('start_method'):  # how the loaders start their workers (Python 3.14 defaults to forkserver)
        torch.multiprocessing.set_start_method(CONFIG['start_method'], force=True)
    count_cache_builds()
    count_decodes()
    opt = cli.parse_args(argv, ROOT, TASK)
    plan = build.plan_start(opt)
    cli.check_options(opt, comm.launched_world_size(), TASK)
    device = comm.select_device(opt.device)
    with comm.process_group(device, 300):
        trainer = build.prepare(TASK, opt, device, plan)
        try:
            observed = comm.all_gather_object({mode: PROBES[mode](trainer) for mode in modes})
        finally:
            trainer.close()
        if comm.is_primary():
            out.write_text(json.dumps({'ranks': observed, 'world': trainer.world}))


if __name__ == '__main__':
    main()
    failures.exit_without_teardown(0)  # as the entry points end a run: the teardown of torch costs 0.5 to 1 s
