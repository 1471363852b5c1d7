"""The one training loop of the kit's entry points: fit() runs epochs of train_step(), and calls its parts (parts/)
at fixed points: before training, before and after each step, after each epoch, after training. What happens there
(a periodic checkpoint, a stop on a signal, the epoch's end, the finish) is a part's; what differs between
upstream's training scripts is a task's (tasks.py); building the model, optimizer, loaders and resumed state is
build.py's.

Imported from a patched YOLOv9 clone: upstream's modules come from the clone, the kit's from yolov9_ddp/ in it.
"""
import gc
import math
import time
from contextlib import nullcontext
from datetime import datetime

import numpy as np
import torch
import torch.nn as nn
from tqdm import tqdm

from utils.general import LOGGER, TQDM_BAR_FORMAT, colorstr, labels_to_image_weights
from yolov9_ddp import comm, failures, runs, state, stream
from yolov9_ddp.checkpoints import FORMAT
from yolov9_ddp.parts import acts_at
from yolov9_ddp.progress import PROGRESS_EVERY, LaggingLosses

NOMINAL_BATCH = 64  # upstream's nbs: gradients are accumulated up to this many images per optimizer step
POINTS = ('before_train', 'before_step', 'after_step', 'after_epoch', 'after_train')


class Trainer:
    """One training run of a task, built by build.py: fit() trains from the run's state to its last epoch.

    run: what build.py made (model, optimizer, loaders, loggers, ...), as attributes of this object."""

    def __init__(self, parts, **run):
        self.__dict__.update(run)
        self.parts = list(parts)
        self.at = {point: [getattr(part, point) for part in self.parts if acts_at(part, point)]
                   for point in POINTS}  # each point calls only the parts that act there
        self.last, self.best = self.weights_dir / 'last.pt', self.weights_dir / 'best.pt'
        self.mloss = None  # the epoch's running mean losses, on the device
        self.stop_early = False  # set by the epoch's end (early stopping)
        self.results = self.task.empty_results()  # the metrics, then the validation losses

    def call(self, point: str, *args):
        for act in self.at[point]:
            act(self, *args)

    def fit(self):
        opt, run = self.opt, self.state
        self.callbacks.run('on_train_start')
        LOGGER.info(f'Image sizes {self.imgsz} train, {self.imgsz} val\n'
                    f'{self.world} process(es), batch {self.batch_size} ({self.batch_size // self.world} per process), '
                    f'{self.train_loader.num_workers} dataloader workers per process\n'
                    f"Logging results to {colorstr('bold', self.save_dir)}\n"
                    f'Starting training for {opt.epochs} epochs...')
        self.call('before_train')
        t0, first = time.time(), run.epoch
        for epoch in range(first, opt.epochs):
            self.callbacks.run('on_train_epoch_start')
            started = time.time()
            self.train_epoch(epoch, run.step if epoch == first else 0)
            self.trained_s = time.time() - started
            self.lr = [x['lr'] for x in self.optimizer.param_groups]
            self.scheduler.step()
            self.call('after_epoch', epoch)
            if self.stop_early:
                break
        self.batches.end()
        LOGGER.info(f'\n{run.epoch - first} epochs completed in {(time.time() - t0) / 3600:.3f} hours.')
        self.call('after_train')

    def train_epoch(self, epoch: int, start_step: int = 0):
        opt, dataset, run = self.opt, self.dataset, self.state
        run.epoch, run.step = epoch, start_step
        self.model.train()
        if opt.image_weights:  # one process only (checked in cli)
            class_weights = self.raw_model.class_weights.cpu().numpy() * (1 - self.maps) ** 2 / self.nc
            weights = labels_to_image_weights(dataset.labels, nc=self.nc, class_weights=class_weights)
            dataset.indices = stream.image_weights_draw(opt.seed, epoch).choices(range(dataset.n), weights=weights,
                                                                                 k=dataset.n)
        if epoch == opt.epochs - opt.close_mosaic:
            LOGGER.info('Closing dataloader mosaic')  # the epoch of each sample decides (yolov9_ddp.stream)
        losses = self.task.loss_names
        self.mloss = torch.zeros(len(losses), device=self.device) if not start_step else \
            self.resumed_mean_loss.to(self.device)
        columns = ('Epoch', 'GPU_mem', *losses, 'Instances', 'Size')
        LOGGER.info(('\n' + '%11s' * len(columns)) % columns)
        batches = enumerate(self.batches.of_epoch(epoch, start_step), start_step)
        pbar = tqdm(batches, total=self.nb, initial=start_step, bar_format=TQDM_BAR_FORMAT, disable=not self.primary)
        self.zero_grad()
        progress = LaggingLosses()
        for i, batch in pbar:
            self.call('before_step', epoch, i)
            self.callbacks.run('on_train_batch_start')
            ni = i + self.nb * epoch
            imgs, targets, paths = batch[:3]
            imgs = imgs.to(self.device, non_blocking=self.cuda).float() / 255  # page-locked: no wait (data.py)
            if self.perf.channels_last:
                imgs = imgs.contiguous(memory_format=torch.channels_last)
            loss_items = self.train_step(ni, epoch, imgs, self.loss_targets(targets),
                                         **self.task.loss_inputs(batch, self.device, self.cuda))
            self.mloss = (self.mloss * i + loss_items) / (i + 1)
            run.step = i + 1
            self.call('after_step', epoch, i + 1)
            if self.primary:
                last = i == self.nb - 1
                shown = progress.shown(self.mloss, last) if i % PROGRESS_EVERY == 0 or last else None
                if shown is not None:
                    mem = f'{torch.cuda.memory_reserved() / 1E9 if torch.cuda.is_available() else 0:.3g}G'
                    pbar.set_description(('%11s' * 2 + '%11.4g' * (len(losses) + 2)) %
                                         (f'{epoch}/{opt.epochs - 1}', mem, *shown, targets.shape[0], imgs.shape[-1]))
                self.callbacks.run('on_train_batch_end', self.raw_model, ni, imgs, targets, paths, list(self.mloss),
                                   **self.task.plot_inputs(batch))
        run.epoch, run.step = epoch + 1, 0

    def loss_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """The batch's targets as the loss takes them: the loader's (on the host) with dense_box_loss, where the task's
        loss pads them there without waiting for the GPU (patch 0016), else copied to the device."""
        if self.perf.dense_box_loss and self.task.takes_dense_box_loss:
            return targets
        return targets.to(self.device, non_blocking=self.cuda)

    def warmup(self, ni, epoch):
        """Upstream's warmup: accumulation, learning rates and momentum ramp up over the first iterations."""
        x = [0, self.warmup_iters]
        self.state.accumulate = max(1, np.interp(ni, x, [1, NOMINAL_BATCH / self.batch_size]).round())
        for j, group in enumerate(self.optimizer.param_groups):
            start = self.hyp['warmup_bias_lr'] if j == 0 else 0.0
            group['lr'] = np.interp(ni, x, [start, group['initial_lr'] * self.lf(epoch)])
            if 'momentum' in group:
                group['momentum'] = np.interp(ni, x, [self.hyp['warmup_momentum'], self.hyp['momentum']])

    def train_step(self, ni, epoch, imgs, targets, **loss_inputs):
        """Forward, backward and (every `accumulate` images) an optimizer step; returns the loss items.
        loss_inputs: what the task's loss takes besides the targets (segmentation: the masks)."""
        opt, run = self.opt, self.state
        if ni <= self.warmup_iters:
            self.warmup(ni, epoch)
        if opt.multi_scale:
            imgs = self.rescale(imgs, ni)
        steps = ni - run.last_opt_step >= run.accumulate
        # micro-steps that do not step skip DDP's gradient all-reduce; the stepping one reduces the sum
        sync = nullcontext() if steps or self.world == 1 else self.model.no_sync()
        with sync:
            try:
                loss_items = self.backward(imgs, targets, loss_inputs)
            except torch.OutOfMemoryError:
                if not self.graphs_in_use or run.last_opt_step != ni - 1:
                    raise  # no graphs to let go, or another micro-step's gradients held
            else:
                return self.stepped(ni, steps, loss_items)
        # Out of GPU memory beside the graphs, where no other micro-step's gradients are held: the graphs go and the
        # micro-step runs again eagerly, from no gradients (its BatchNorm statistics are updated twice, once).
        self.optimizer.zero_grad(set_to_none=True)
        self.forward.step_down('in a training step')  # once the error and the tensors its frames hold are gone
        return self.stepped(ni, steps, self.backward(imgs, targets, loss_inputs))

    def backward(self, imgs, targets, loss_inputs) -> torch.Tensor:
        """A micro-step's forward, loss and backward; its loss items."""
        with torch.amp.autocast('cuda', enabled=self.amp, cache_enabled=not self.perf.cuda_graphs):
            pred = self.forward(imgs)
            loss, loss_items = self.compute_loss(pred, targets, **loss_inputs)
            loss *= self.world  # DDP averages gradients over ranks; upstream's loss is a sum over the batch
            if self.opt.quad:
                loss *= 4.
        self.scaler.scale(loss).backward()
        return loss_items

    def stepped(self, ni, steps: bool, loss_items):
        """loss_items, after the optimizer step where the micro-step ends an accumulation."""
        if steps:
            self.optimizer_step()
            self.state.last_opt_step = ni
        return loss_items

    @property
    def graphs_in_use(self) -> bool:
        """Whether CUDA graphs replay the model's steps: an out-of-memory error can be met by letting them go."""
        return self.perf.cuda_graphs and not self.forward.eager

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

    def at_boundary(self, epoch: int, step: int) -> bool:
        """Whether the run stands at an optimizer-step boundary after step batches of epoch (no gradient pending)."""
        return self.state.last_opt_step == step - 1 + self.nb * epoch

    def validate(self, model, plots, compute_loss=True):
        """Every rank validates its shard; the task's validation run() gathers the statistics (patched upstream:
        distributed=True), so all ranks get the same metrics, those of one process over the whole set. Out of GPU
        memory beside CUDA graphs, the graphs go (graphs.GraphedModel.step_down) and it runs again."""
        try:
            return self.validated(model, plots, compute_loss)
        except torch.OutOfMemoryError:
            if not self.graphs_in_use:
                raise
        self.forward.step_down('in validation')  # once the error and the tensors its frames hold are gone
        return self.validated(model, plots, compute_loss)

    def validated(self, model, plots, compute_loss=True):
        """The task's validation, with cuDNN's default algorithms as upstream's: its rectangular batches have many
        shapes, and autotuning each new one spends time and workspace memory on the first epochs."""
        benchmark, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, False
        try:
            return self.task.validate(data=self.data_dict, batch_size=self.batch_size // self.world * 2,
                                      imgsz=self.imgsz, half=self.amp, model=model, single_cls=self.opt.single_cls,
                                      dataloader=self.val_loader, save_dir=self.save_dir,
                                      plots=plots and self.primary, verbose=plots, callbacks=self.callbacks,
                                      compute_loss=self.compute_loss if compute_loss else None,
                                      distributed=self.world > 1, **self.task.validation_options(self.opt))
        finally:
            torch.backends.cudnn.benchmark = benchmark

    def save(self, epoch: int, step: int, name: str, then=(), skip_if_busy=False, strip=False) -> bool:
        """The run's checkpoint at (epoch, step) into last.pt (stripped with strip: the run's final one), written off
        the training thread by rank 0, run.json recording it once in place (then: what else to do then, in the
        writer's thread). Every rank takes part: mid-epoch each rank's own statistics are gathered."""
        ranks = None
        if step:  # at an epoch's start the ranks hold the statistics synchronised at the end of the last
            own = state.rank_state(self.raw_model, self.ema.ema, self.mloss)
            ranks = comm.all_gather_object(state.in_host_memory(own)) if self.world > 1 else [own]
        if not self.primary:
            return False
        recorded = lambda: runs.write_record(self.save_dir, saved_epoch=epoch - 1, saved_position=[epoch, step])
        return self.checkpoints.save(lambda: self.checkpoint(epoch, step, ranks), self.last, name, (recorded, *then),
                                     skip_if_busy, strip)

    def checkpoint(self, epoch: int, step: int, ranks) -> dict:
        """Upstream's checkpoint (its scripts read the kit's) with the run's state at (epoch, step)."""
        return {'model': self.raw_model, 'ema': self.ema.ema, 'optimizer': self.optimizer.state_dict(),
                **self.state.state_dict(epoch, step, ranks), 'opt': self.recorded_options(), 'git': None,
                'date': datetime.now().isoformat(), 'format': FORMAT}

    def recorded_options(self) -> dict:
        return {k: v for k, v in vars(self.opt).items() if k != 'save_dir'}

    def close(self):
        """On every way out: the write under way completes (the signal handlers still record a SIGTERM meanwhile,
        torchrun's to a rank whose peer failed), the parts let go of what they hold, and this rank's loader workers
        end, which would otherwise live on (persistent ones until their iterator is garbage-collected, maybe never)."""
        if self.checkpoints is not None:
            self.checkpoints.close()
        for part in self.parts:
            part.close(self)
        failures.end_children()
        gc.unfreeze()  # a process that goes on (a test's) collects the run's objects again
