"""Validation uses ShardBatchSampler: the dataset's batches, in order, cut into one contiguous run of whole batches
per rank. No padding, no image twice, and each rank's batches are exactly the batches a single process would build,
so the per-image results equal a single-process run's. Training's stream (shuffled, or --rect's fixed batches) is
yolov9_ddp.stream.
"""
import math

from torch.utils.data import Sampler


class ShardBatchSampler(Sampler):
    """Yields the batches [i*b, (i+1)*b) of rank's contiguous share of the ceil(n/b) batches."""

    def __init__(self, num_items: int, batch_size: int, rank: int, world_size: int):
        self.num_items, self.batch_size = num_items, batch_size
        num_batches = math.ceil(num_items / batch_size)
        self.first = num_batches * rank // world_size
        self.last = num_batches * (rank + 1) // world_size  # exclusive

    def __iter__(self):
        for batch in range(self.first, self.last):
            yield list(range(batch * self.batch_size, min((batch + 1) * self.batch_size, self.num_items)))

    def __len__(self):
        return self.last - self.first

    def set_epoch(self, epoch):  # same interface as DistributedSampler; the shards never change
        pass
