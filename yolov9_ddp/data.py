"""Datasets and loaders for training and distributed validation, built on upstream's LoadImagesAndLabels. Building
a dataset writes its label cache, so it runs staged (comm.run_staged): the cache is written once per folder."""
import os
import signal
from functools import partial
from itertools import islice

import torch
from torch.utils.data import DataLoader

from yolov9_ddp import comm, failures, ramcache, shutdown
from yolov9_ddp.samplers import ShardBatchSampler
from yolov9_ddp.stream import QUAD, SeededSamples, StreamSampler

WORKER_SEED_BASE = 6148914691236517205  # upstream's generator seed base; + rank, so ranks augment differently


class DataError(Exception):
    """The dataset cannot be loaded (no images, no labels, unreadable files); the message names it."""


CPUS_KEPT_PER_PROCESS = 4  # for the training process itself, its pin-memory thread and the system
PREFETCH_BATCHES = 4  # per loader worker


def loader_workers(requested: int, batch_size: int) -> int:
    """Workers per process: the request, capped by this node's CPUs per local process less a few kept free (the
    augmentation is CPU-bound, and oversubscribed CPUs thrash)."""
    per_process = (os.cpu_count() or 1) // comm.get_local_world_size() - CPUS_KEPT_PER_PROCESS
    return min(requested, max(1, per_process), batch_size if batch_size > 1 else 0)


def build_dataset(task, path, imgsz, batch_size, stride, opt, hyp, augment, rect, cache, pad, prefix):
    """The task's dataset (upstream's LoadImagesAndLabels, or its subclass with masks for segmentation)."""
    def build():
        try:
            return task.dataset_class()(path, imgsz, batch_size, augment=augment, hyp=hyp, rect=rect,
                                        image_weights=opt.image_weights and augment, cache_images=disk_cache(cache),
                                        single_cls=opt.single_cls, stride=int(stride), pad=pad,
                                        min_items=getattr(opt, 'min_items', 0), prefix=prefix,
                                        **task.dataset_options(opt))
        except Exception as e:  # upstream raises bare Exception/AssertionError for missing images or labels
            raise DataError(str(e).replace(prefix, '').split('\nSee ')[0]) from e
    return with_shared_ram_cache(comm.run_staged(build), cache, prefix)


def disk_cache(cache):
    """What upstream's dataset caches by itself: --cache disk (.npy files beside the images) and nothing else."""
    return 'disk' if cache == 'disk' else None


def with_shared_ram_cache(dataset, cache, prefix):
    """--cache ram (upstream caches in RAM for any value but 'disk'): one decoded copy per node, not per rank."""
    if cache and cache != 'disk':
        from utils.general import LOGGER, NUM_THREADS  # upstream's modules load once a run's options are checked
        try:
            ramcache.share_images(dataset, prefix, LOGGER.info, NUM_THREADS)
        except ramcache.CacheError as e:
            raise DataError(str(e).replace(prefix, '')) from e
    return dataset


class TrainingBatches:
    """The training loader's batches (stream.py), epoch by epoch. Where the workers persist, one iterator serves the
    run's remaining epochs, so that they load the next epoch's first batches while this one ends (a new iterator
    starts every worker idle, and the GPU waits for a whole batch); else, with --image-weights, one an epoch."""

    def __init__(self, loader, epochs: int):
        self.loader, self.epochs, self.run_long = loader, epochs, None

    def of_epoch(self, epoch: int, start_step: int = 0):
        sampler = self.loader.batch_sampler
        if not self.loader.persistent_workers:
            sampler.set_epoch(epoch, start_step)
            return iter(self.loader)
        if self.run_long is None:
            sampler.set_epoch(epoch, start_step, until_epoch=self.epochs)
            self.run_long = iter(self.loader)
        return islice(self.run_long, sampler.steps - start_step)

    def end(self):
        """Training is over: the persistent workers end now, not with the process. One the kernel killed meanwhile
        (its out-of-memory killer picks a worker) would fail a run whose training has ended, in its finish."""
        if self.run_long is not None:
            self.run_long._shutdown_workers()  # what the iterator's __del__ does; the loader keeps a reference
            self.run_long = self.loader._iterator = None


def init_worker(worker_id, trainer_pid):
    """Loader workers leave SIGTERM/SIGINT to their trainer (a worker dying first of torchrun's signal to the group
    would crash its trainer mid-step), and the kernel kills them when the trainer dies."""
    for signum in shutdown.HANDLED:
        signal.signal(signum, signal.SIG_IGN)
    failures.die_with_parent(trainer_pid)
    from utils.dataloaders import seed_worker  # loaded already: the trainer imported it before forking workers
    seed_worker(worker_id)


def make_loader(dataset, batch_sampler, workers, cuda, collate_fn, persistent=True):
    """Page-locked batches on a GPU (copied without a wait), workers that persist across epochs (as upstream's
    InfiniteDataLoader) and PREFETCH_BATCHES ready in each."""
    generator = torch.Generator()
    generator.manual_seed(WORKER_SEED_BASE + comm.get_rank())
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=workers, pin_memory=cuda,
                      collate_fn=collate_fn, worker_init_fn=partial(init_worker, trainer_pid=os.getpid()),
                      generator=generator, persistent_workers=workers > 0 and persistent,
                      prefetch_factor=PREFETCH_BATCHES if workers > 0 else None)


def train_loader(task, path, imgsz, batch_per_rank, stride, opt, hyp, cuda, prefix):
    rank, world = comm.get_rank(), comm.get_world_size()
    global_batch = batch_per_rank * world  # --rect's batch shapes are the global batches' (StreamSampler)
    dataset = build_dataset(task, path, imgsz, global_batch, stride, opt, hyp, augment=True, rect=opt.rect,
                            cache=None if opt.cache == 'val' else opt.cache, pad=0.0, prefix=prefix)
    batches = StreamSampler(len(dataset), global_batch, rank, world, opt.seed, shuffle=not opt.rect, quad=opt.quad)
    if not batches.steps:
        raise DataError(f'--quad: the {len(dataset)} training images fill no global batch with {QUAD} images for '
                        f'each of the {world} process(es); train on more images or without --quad')
    mosaic_until = opt.epochs - opt.close_mosaic if opt.close_mosaic else None
    samples = SeededSamples(dataset, opt.seed, mosaic_until)
    workers = loader_workers(opt.workers, batch_per_rank)
    # --image-weights: each epoch's draw goes into the dataset's indices in the training process (Trainer), which
    # workers kept across epochs would not see
    return make_loader(samples, batches, workers, cuda, task.collate(opt.quad), persistent=not opt.image_weights), \
        dataset


def val_loader(task, path, imgsz, batch_per_rank, stride, opt, cuda, prefix):
    dataset = build_dataset(task, path, imgsz, batch_per_rank, stride, opt, hyp=None, augment=False, rect=True,
                            cache=None if opt.noval else opt.cache, pad=0.5, prefix=prefix)
    shards = ShardBatchSampler(len(dataset), batch_per_rank, comm.get_rank(), comm.get_world_size())
    workers = loader_workers(opt.workers * 2, batch_per_rank)
    return make_loader(dataset, shards, workers, cuda, task.collate(quad=False))
