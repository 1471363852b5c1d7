"""Probes run inside a patched YOLOv9 tree, one process or one per torchrun rank, that drive the real
ddp_train_dual.Trainer and report what each rank saw as JSON (written by rank 0).

    python probe.py MODE OUT.json TRAIN_ARGS...          (cwd: the patched tree; PROBE_CONFIG: JSON options)
"""
import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import ddp_train_dual as dtd  # noqa: E402
from utils.dataloaders import LoadImagesAndLabels  # noqa: E402
from yolov9_ddp import cli, comm, data  # noqa: E402

CONFIG = json.loads(os.environ.get('PROBE_CONFIG') or '{}')


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
    epochs = []
    for epoch in range(CONFIG.get('epochs', 3)):
        data.set_epoch(trainer.train_loader, epoch)
        epochs.append([p for _, _, paths, _ in trainer.train_loader for p in paths])
    return {'epochs': epochs, 'cache_builds': BUILDS, 'files': list(trainer.dataset.im_files),
            'padding_bound': trainer.world - 1}


def probe_step(trainer):
    """Optimizer steps on a fixed global batch, from fixed weights, with BatchNorm statistics frozen.

    The global batch is cut into CONFIG['micro'] micro-batches, contiguous runs of them per rank; each rank
    accumulates its share, so one process with M micro-batches and W processes with M/W each take the
    same optimizer step. BatchNorm layers run in eval mode: in train mode a layer normalises with the
    statistics of the rank's own images, which no real DDP run (without SyncBatchNorm) shares either.
    """
    model = trainer.raw_model
    model.load_state_dict(torch.load(CONFIG['init'], weights_only=True))
    trainer.model.train()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    batch = torch.load(CONFIG['batch'], weights_only=True)
    images, targets = batch['images'], batch['targets']
    micro, world, rank = CONFIG['micro'], trainer.world, trainer.rank
    per_rank, size = micro // world, len(images) // micro
    trainer.accumulate, trainer.last_opt_step, trainer.warmup_iters = per_rank, -1, -1
    grads_after_first = None
    for step in range(per_rank):
        first = (rank * per_rank + step) * size
        chunk = (targets[:, 0] >= first) & (targets[:, 0] < first + size)
        micro_targets = targets[chunk].clone()
        micro_targets[:, 0] -= first
        trainer.train_step(step, 0, images[first:first + size].float() / 255, micro_targets)
        if step == 0 and per_rank > 1:
            grads_after_first = [p.grad.detach().double().sum().item() for p in model.parameters()
                                 if p.grad is not None][:8]
    return {'params': {k: v.detach().cpu().double().flatten().tolist()
                       for k, v in model.state_dict().items() if v.dtype.is_floating_point},
            'grads_after_first_micro_step': grads_after_first}


def probe_ema(trainer):
    """EMA and BatchNorm statistics around the per-epoch synchronisation, for each epoch."""
    seen = []
    original = dtd.synchronize_ema

    def recording(ema, model):
        before = first_norm(model).running_mean.tolist()
        original(ema, model)
        seen.append({'ema_hash': state_hash(ema.ema), 'bn_before': before,
                     'bn_after': first_norm(model).running_mean.tolist(),
                     'ema_updates': ema.updates})

    dtd.synchronize_ema = recording
    for epoch in range(trainer.opt.epochs):
        mloss = trainer.train_epoch(epoch)
        trainer.end_epoch(epoch, mloss, [g['lr'] for g in trainer.optimizer.param_groups])
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
    import val_dual
    from utils.dataloaders import create_dataloader
    batch = trainer.batch_size * 2
    loader = create_dataloader(trainer.data_dict['val'], trainer.imgsz, batch, int(model.stride.max()),
                               pad=0.5, rect=True, workers=0)[0]
    results, _, _ = val_dual.run(trainer.data_dict, batch_size=batch, imgsz=trainer.imgsz, model=model,
                                 dataloader=loader, half=False, plots=False)
    return [float(x) for x in results]


PROBES = {'sampler': probe_sampler, 'step': probe_step, 'ema': probe_ema, 'val': probe_val}
BUILDS = []  # (rank, cache path) of every label-cache build in this process


def count_cache_builds():
    original = LoadImagesAndLabels.cache_labels

    def counting(self, path, prefix=''):
        BUILDS.append([comm.get_rank(), str(path)])
        return original(self, path, prefix)

    LoadImagesAndLabels.cache_labels = counting


def main():
    mode, out, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    count_cache_builds()
    opt = cli.parse_args(argv, ROOT)
    cli.check_options(opt, comm.launched_world_size())
    device = comm.select_device(opt.device)
    with comm.process_group(device, 300):
        trainer = dtd.prepare_trainer(opt, device)
        observed = comm.all_gather_object(PROBES[mode](trainer))
        if comm.is_primary():
            out.write_text(json.dumps({'ranks': observed, 'world': trainer.world}))


if __name__ == '__main__':
    main()
