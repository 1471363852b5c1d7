"""The training data stream: which images each process trains at each step, and the randomness of every sample, as
a function of (seed, epoch, position) alone, not of the number of processes, loader workers or restarts, so that a
checkpoint is a position and a run continues exactly on any number of processes.

  - An epoch's order is a permutation drawn from (seed, epoch); with --rect, the dataset's own (upstream's
    rectangular batches). Global batch k is positions [k*B, (k+1)*B) of it; rank r of W trains its r-th share. A
    last batch smaller than W is filled up with the first images of the order.
  - Each sample is loaded with Python's and NumPy's generators seeded from a hash of (seed, epoch, index), set in
    the loader worker before upstream's __getitem__: mosaic partners, affine, HSV, flips, mixup and copy-paste draw
    the same values whichever worker, rank or restart loads it (a hash: idx + seed + epoch, as Megatron's, gives
    (epoch 1, index 0) the randomness of (epoch 0, index 1)).
  - A step's multi-scale size comes from (seed, step); --image-weights' draw of an epoch from (seed, epoch).

The sampler yields keys (epoch, index), so that persistent loader workers know each sample's epoch, which also
decides mosaic: upstream's --close-mosaic sets dataset.mosaic in the training process, which workers never see.
"""
import math
import random

import numpy as np
from torch.utils.data import Dataset, Sampler

# what a seed is for, so that the streams of the order, the samples and the sizes never share one
ORDER, SAMPLE, SCALE, IMAGE_WEIGHTS = range(4)
QUAD = 4  # the images upstream's collate_fn4 (--quad) makes one of


def seed_of(purpose: int, *keys: int) -> int:
    """A 64-bit seed from (purpose, seed, epoch, ...): NumPy's SeedSequence hashes the whole tuple."""
    entropy = [purpose, *(k % 2 ** 64 for k in keys)]  # SeedSequence takes non-negative ints; --seed may be < 0
    low, high = np.random.SeedSequence(entropy).generate_state(2)
    return int(high) << 32 | int(low)


def epoch_order(num_images: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng(seed_of(ORDER, seed, epoch)).permutation(num_images)


def steps_per_epoch(num_images: int, global_batch: int) -> int:
    return math.ceil(num_images / global_batch)


def rank_share(num_images: int, global_batch: int, step: int, rank: int, world: int) -> range:
    """The positions of the epoch's order that rank trains at step: its share of global batch step."""
    first = step * global_batch
    size = min(global_batch, num_images - first)
    size = max(size, world)  # fewer images than processes: the share wraps to the start of the order
    return range(first + size * rank // world, first + size * (rank + 1) // world)


def last_batch_size(num_images: int, global_batch: int) -> int:
    return num_images - (steps_per_epoch(num_images, global_batch) - 1) * global_batch


def repeats_per_epoch(num_images: int, global_batch: int, world: int) -> int:
    """How many images the last global batch repeats: none unless it holds fewer images than processes."""
    last = last_batch_size(num_images, global_batch)
    return max(world - last, 0)


def scale_draw(seed: int, step: int) -> random.Random:
    """The generator of a step's multi-scale size: the same on every rank, in every start."""
    return random.Random(seed_of(SCALE, seed, step))


def image_weights_draw(seed: int, epoch: int) -> random.Random:
    return random.Random(seed_of(IMAGE_WEIGHTS, seed, epoch))


class StreamSampler(Sampler):
    """A batch sampler: rank's share of each global batch of the epochs set by set_epoch, as lists of keys
    (epoch, image index), from the step set_epoch names on.

    shuffle=False (--rect): the dataset is built with the global batch, so that the images of global batch k have
    upstream's shape for it whichever rank trains them. quad (--quad): collate_fn4 makes one image of each four, so a
    last global batch that leaves a rank fewer than four is left out of the epoch."""

    def __init__(self, num_images: int, global_batch: int, rank: int, world: int, seed: int, shuffle=True,
                 quad=False):
        assert global_batch % world == 0, 'checked before: the world size divides the global batch'
        self.num_images, self.global_batch, self.seed, self.shuffle = num_images, global_batch, seed, shuffle
        self.rank, self.world = rank, world
        self.steps = steps_per_epoch(num_images, global_batch)
        if quad and last_batch_size(num_images, global_batch) // world < QUAD:  # the last step's smallest share
            self.steps -= 1
        self.set_epoch(0)

    def set_epoch(self, epoch: int, start_step: int = 0, until_epoch: int = None):
        """The batches from step start_step of epoch on, to the end of epoch until_epoch - 1 (by default epoch's)."""
        self.epoch, self.start = epoch, start_step
        self.until = epoch + 1 if until_epoch is None else until_epoch

    def __iter__(self):
        for epoch in range(self.epoch, self.until):
            yield from self.batches_of(epoch, self.start if epoch == self.epoch else 0)

    def batches_of(self, epoch: int, start_step: int):
        order = epoch_order(self.num_images, self.seed, epoch) if self.shuffle else np.arange(self.num_images)
        for step in range(start_step, self.steps):
            share = rank_share(self.num_images, self.global_batch, step, self.rank, self.world)
            yield [(epoch, int(order[p % self.num_images])) for p in share]

    def __len__(self):
        return (self.until - self.epoch) * self.steps - self.start


class SeededSamples(Dataset):
    """Upstream's training dataset, each sample loaded with its own seeds (see the module doc).

    mosaic_until: the first epoch without mosaic (--close-mosaic), or None."""

    def __init__(self, dataset, seed: int, mosaic_until=None):
        self.dataset, self.seed, self.mosaic_until = dataset, seed, mosaic_until
        self.mosaic = dataset.mosaic

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        seed = seed_of(SAMPLE, self.seed, epoch, index)
        random.seed(seed)
        np.random.seed(seed % 2 ** 32)
        self.dataset.mosaic = self.mosaic and (self.mosaic_until is None or epoch < self.mosaic_until)
        return self.dataset[index]
