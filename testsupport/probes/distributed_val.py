"""Upstream's val scripts on their own, inside a patched YOLOv9 tree (cwd):

    python distributed_val.py TASK CFG DATA_YAML OUT.pt     fit a model to the validation images, save it

overfits the tiny model to the validation images for a few steps with the task's own loss, so that the metrics
compared are not all zero. TASK is one of TASKS: which val module, loss and dataset the task uses.
validate_shard() (probe.py's upstream_val) runs TASK's run(..., distributed=True) on one rank's shard of whole
batches (the kit's ShardBatchSampler), beside the kit's trainer in the same job.
"""
import importlib
import sys
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from utils.callbacks import Callbacks  # noqa: E402
from utils.dataloaders import LoadImagesAndLabels  # noqa: E402
from utils.general import check_dataset  # noqa: E402
from utils.segment.dataloaders import LoadImagesAndLabelsAndMasks  # noqa: E402
from yolov9_ddp.samplers import ShardBatchSampler  # noqa: E402
from yolov9_ddp.tasks import TASKS  # noqa: E402

MASK_RATIO = 4  # upstream's --mask-ratio default
FIT_STEPS, FIT_BATCH, FIT_LR = 80, 8, 0.01


def dataset(data: dict, task: str, imgsz: int, batch: int, stride: int, rect: bool):
    masks = TASKS[task].masks
    kind = LoadImagesAndLabelsAndMasks if masks else LoadImagesAndLabels
    extra = {'downsample_ratio': MASK_RATIO, 'overlap': True} if masks else {}
    return kind(data['val'], imgsz, batch, augment=False, rect=rect, stride=stride, pad=0.5 if rect else 0.0,
                **extra)


def task_loss(task: str, model):
    model.hyp = yaml.safe_load((ROOT / 'data' / 'hyps' / 'hyp.scratch-high.yaml').read_text())
    loss_class = importlib.import_module(TASKS[task].loss_module).ComputeLoss
    return loss_class(model, overlap=True) if TASKS[task].masks else loss_class(model)


def losses(task, compute_loss, batch, model):
    images, targets, masks = batch[0].float() / 255, batch[1], batch[4] if TASKS[task].masks else None
    pred = model(images)
    return compute_loss(pred, targets, masks.float())[0] if masks is not None else compute_loss(pred, targets)[0]


def fit(task: str, cfg: str, data_yaml: str, out: Path, imgsz=64):
    from models.yolo import Model
    torch.manual_seed(0)
    data = check_dataset(data_yaml)
    model = Model(cfg, ch=3, nc=int(data['nc']))
    model.names = data['names']
    compute_loss = task_loss(task, model)
    images = dataset(data, task, imgsz, FIT_BATCH, int(model.stride.max()), rect=False)
    loader = DataLoader(images, FIT_BATCH, shuffle=True, collate_fn=images.collate_fn,
                        generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam(model.parameters(), FIT_LR)
    model.train()
    step = 0
    while step < FIT_STEPS:
        for batch in loader:
            optimizer.zero_grad()
            losses(task, compute_loss, batch, model).backward()
            optimizer.step()
            step += 1
    torch.save({'model': model.eval()}, out)


def validate_shard(task: str, weights: str, data_yaml: str, save_dir: Path, batch: int, rank: int, world: int,
                   imgsz=64) -> dict:
    """What TASK's run(..., distributed=world > 1) reports on this rank's shard (in a process group already up)."""
    from models.experimental import attempt_load
    data = check_dataset(data_yaml)
    model = attempt_load(weights, device='cpu')
    images = dataset(data, task, imgsz, batch, int(model.stride.max()), rect=True)
    shard = DataLoader(images, batch_sampler=ShardBatchSampler(len(images), batch, rank, world),
                       collate_fn=images.collate_fn)
    compute_loss = task_loss(task, model)
    run = importlib.import_module(TASKS[task].validator).run
    extra = {'overlap': True, 'mask_downsample_ratio': MASK_RATIO} if TASKS[task].masks else {}
    callbacks, confusion = Callbacks(), []  # the detection scripts hand the matrix they plot to on_val_end
    callbacks.register_action('on_val_end', callback=lambda *args: confusion.append(args[-1].matrix.tolist()))
    results, maps, _ = run(data, batch_size=batch, imgsz=imgsz, half=False, model=model, dataloader=shard,
                           plots=rank == 0, save_dir=Path(save_dir), callbacks=callbacks, compute_loss=compute_loss,
                           distributed=world > 1, **extra)  # as the kit: rank 0 plots
    return {'results': [float(x) for x in results], 'maps': [float(x) for x in maps], 'batches': len(shard),
            'confusion': confusion[0] if confusion else None}


def main():
    fit(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]))


if __name__ == '__main__':
    main()
