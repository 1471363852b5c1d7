"""What differs between upstream's training scripts, one small named piece per task; trainer.py is the one training
loop for all of them (as ultralytics' BaseTrainer with its detect and segment trainers).

    upstream script          kit entry point             head of the models it trains
    train.py                 ddp_train.py                Detect, DDetect (GELAN, YOLOv7-AF)
    train_dual.py            ddp_train_dual.py           DualDetect, DualDDetect (YOLOv9)
    train_triple.py          ddp_train_triple.py         TripleDetect, TripleDDetect
    segment/train.py         segment/ddp_train.py        Segment, DSegment
    segment/train_dual.py    segment/ddp_train_dual.py   DualDSegment

A task names upstream's modules; they are imported when a run needs them, from the patched clone.
"""
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import numpy as np

from yolov9_ddp import boxloss
from yolov9_ddp.demo_data import DemoSpec

UPSTREAM_ONLY = {'Panoptic': 'panoptic/train.py'}  # heads no kit entry point trains (one process, upstream's script)


@dataclass(frozen=True)
class Detection:
    """Boxes: train.py, train_dual.py, train_triple.py differ only in their head, loss and validation modules."""
    name: str
    script: str  # the kit's entry point, relative to the clone
    upstream: str  # the upstream script it replaces, relative to the clone
    heads: tuple  # class names of the output layer of the models it trains
    loss_module: str  # upstream's module of its ComputeLoss
    validator: str  # upstream's validation module (its run() takes distributed=True once patched)
    demo_cfg: str  # the kit's tiny model of this task (yolov9_ddp/models/), trained when no model is named
    stripped_suffix: str = ''  # train.py strips last.pt into last_striped.pt; the others strip in place
    flat_and_fixed_lr: bool = True  # --flat-cos-lr and --fixed-lr: train_triple.py and the segment scripts lack them
    masks = False
    model_module = 'models.yolo'  # upstream's module of the model classes (it imports their layers' modules)
    takes_dense_box_loss = True  # its loss pads the targets where they are (patch 0016) and has box losses
    loss_names = ('box_loss', 'cls_loss', 'dfl_loss')
    metric_names = ('P', 'R', 'mAP50', 'mAP50-95')
    demo_folder = 'demo-data'  # beside --project, when --data is not given
    demo_spec = DemoSpec()

    def wrong_entry_point(self, head: str):
        """None when this task trains models with that head; else the one line naming the script that does."""
        if head in self.heads:
            return None
        right = next((task for task in TASKS.values() if head in task.heads), None)
        where = f'train it with {right.script} (for upstream\'s {right.upstream})' if right else \
            f'train it with upstream\'s {UPSTREAM_ONLY[head]} (one process)' if head in UPSTREAM_ONLY else \
            'no training script of YOLOv9 knows that head'
        return f'{self.script} trains models ending in {" or ".join(self.heads)}; this model ends in {head}: {where}'

    def stripped(self, path: Path) -> Path:
        """Where the final checkpoint at path goes without its optimizer, as upstream's script names it."""
        return path.with_name(f'{path.stem}{self.stripped_suffix}{path.suffix}')

    # -- model and loss ------------------------------------------------------------------------------------------

    def model(self, cfg, nc, hyp):
        return import_module(self.model_module).Model(cfg, ch=3, nc=nc, anchors=hyp.get('anchors'))

    def loss(self, model, opt, perf):
        loss = import_module(self.loss_module).ComputeLoss(model)
        return boxloss.weigh_every_anchor(loss) if perf.dense_box_loss else loss

    def loss_inputs(self, batch, device, non_blocking) -> dict:
        """What the loss takes besides predictions and targets (segmentation: the masks)."""
        return {}

    def plot_inputs(self, batch) -> dict:
        """What the loggers' on_train_batch_end takes besides images, targets and paths (segmentation: masks)."""
        return {}

    def loggers(self, save_dir, opt, hyp, console):
        """Rank 0's loggers, whose methods become callbacks of the loop (upstream's Loggers: results.csv, plots,
        TensorBoard)."""
        from utils.loggers import Loggers
        return Loggers(save_dir, opt.weights, opt, hyp, console)

    # -- data ----------------------------------------------------------------------------------------------------

    def dataset_class(self):
        from utils.dataloaders import LoadImagesAndLabels
        return LoadImagesAndLabels

    def dataset_options(self, opt) -> dict:
        return {}

    def collate(self, quad: bool):
        dataset = self.dataset_class()
        return dataset.collate_fn4 if quad else dataset.collate_fn

    # -- validation and metrics ----------------------------------------------------------------------------------

    def validate(self, **kwargs):
        """Upstream's validation run(); returns (results, per-class mAPs, times)."""
        return import_module(self.validator).run(**kwargs)

    def validation_options(self, opt) -> dict:
        return {}

    def empty_results(self) -> tuple:
        return (0,) * (len(self.metric_names) + len(self.loss_names))

    def fitness(self, results) -> float:
        from utils.metrics import fitness
        return float(fitness(np.array(results).reshape(1, -1))[0])

    def summary(self, results) -> str:
        return '  '.join(f'{name} {value:.4f}' for name, value in zip(self.metric_names, results))


@dataclass(frozen=True)
class Segmentation(Detection):
    """Boxes and masks: segment/train.py and segment/train_dual.py. Batches carry the masks, the loss takes them,
    validation measures boxes and masks (--mask-ratio, --no-overlap as upstream)."""
    flat_and_fixed_lr: bool = False
    masks = True
    takes_dense_box_loss = False  # upstream's segmentation losses copy the targets to the GPU themselves
    loss_names = ('box_loss', 'seg_loss', 'cls_loss', 'dfl_loss')
    metric_names = ('P(B)', 'R(B)', 'mAP50(B)', 'mAP50-95(B)', 'P(M)', 'R(M)', 'mAP50(M)', 'mAP50-95(M)')
    demo_folder = 'demo-data-seg'
    demo_spec = DemoSpec(labels='polygons')

    def model(self, cfg, nc, hyp):
        return import_module(self.model_module).SegmentationModel(cfg, ch=3, nc=nc)

    def loss(self, model, opt, perf):  # takes no switch (takes_dense_box_loss)
        return import_module(self.loss_module).ComputeLoss(model, overlap=not opt.no_overlap)

    def loss_inputs(self, batch, device, non_blocking) -> dict:
        return {'masks': batch[4].to(device, non_blocking=non_blocking).float()}

    def plot_inputs(self, batch) -> dict:
        return {'masks': batch[4]}

    def loggers(self, save_dir, opt, hyp, console):
        return SegmentationLoggers(save_dir, opt, console)

    def dataset_class(self):
        from utils.segment.dataloaders import LoadImagesAndLabelsAndMasks
        return LoadImagesAndLabelsAndMasks

    def dataset_options(self, opt) -> dict:
        return {'downsample_ratio': opt.mask_ratio, 'overlap': not opt.no_overlap}

    def collate(self, quad: bool):
        return self.dataset_class().collate_fn  # upstream has no quad collation with masks (checked in cli)

    def validation_options(self, opt) -> dict:
        return {'mask_downsample_ratio': opt.mask_ratio, 'overlap': not opt.no_overlap}

    def fitness(self, results) -> float:
        from utils.segment.metrics import fitness
        return float(fitness(np.array(results).reshape(1, -1))[0])


class SegmentationLoggers:
    """What upstream's segment/train.py logs, as callbacks of the kit's loop on rank 0: results.csv (and
    TensorBoard) through its GenericLogger with utils.segment.metrics.KEYS, label and batch plots with masks."""

    def __init__(self, save_dir, opt, console):
        from utils.loggers import GenericLogger
        self.save_dir, self.plots, self.console = Path(save_dir), not opt.noplots, console
        self.logger = GenericLogger(opt=opt, console_logger=console)

    def on_pretrain_routine_end(self, labels, names):
        if self.plots:
            from utils.plots import plot_labels
            plot_labels(labels, names, self.save_dir)

    def on_train_batch_end(self, model, ni, imgs, targets, paths, vals, masks=None):
        if self.plots and ni < 3:
            from utils.segment.plots import plot_images_and_masks
            plot_images_and_masks(imgs, targets, masks, paths, self.save_dir / f'train_batch{ni}.jpg')

    def on_fit_epoch_end(self, vals, epoch, best_fitness, fi):
        from utils.segment.metrics import KEYS
        self.logger.log_metrics(dict(zip(KEYS, vals)), epoch)

    def on_train_end(self, last, best, epoch, results):
        if self.plots:
            from utils.segment.plots import plot_results_with_masks
            plot_results_with_masks(file=self.save_dir / 'results.csv')
        self.console.info(f'Results saved to {self.save_dir}')


TASKS = {task.name: task for task in (
    Detection('detect', 'ddp_train.py', 'train.py', ('Detect', 'DDetect'), 'utils.loss_tal', 'val', 'tiny.yaml',
              stripped_suffix='_striped'),
    Detection('detect-dual', 'ddp_train_dual.py', 'train_dual.py', ('DualDetect', 'DualDDetect'),
              'utils.loss_tal_dual', 'val_dual', 'tiny-dual.yaml'),
    Detection('detect-triple', 'ddp_train_triple.py', 'train_triple.py', ('TripleDetect', 'TripleDDetect'),
              'utils.loss_tal_triple', 'val_triple', 'tiny-triple.yaml', flat_and_fixed_lr=False),
    Segmentation('segment', 'segment/ddp_train.py', 'segment/train.py', ('Segment', 'DSegment'),
                 'utils.segment.loss_tal', 'segment.val', 'tiny-seg.yaml'),
    Segmentation('segment-dual', 'segment/ddp_train_dual.py', 'segment/train_dual.py', ('DualDSegment',),
                 'utils.segment.loss_tal_dual', 'segment.val_dual', 'tiny-seg-dual.yaml'),
)}
