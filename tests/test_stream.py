"""The training data stream (yolov9_ddp.stream): which images each rank trains at each step, and each sample's
randomness, depend on (seed, epoch, position) alone. Unit tests on the sampler and the dataset wrapper; the
trainings that show it end to end (bit-identical weights across loader workers, resumes and restarts; every image
once on 2, then 3, then 2 processes) are in tests/test_same_run.py."""
import random
import time
from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DataLoader

from yolov9_ddp.data import TrainingBatches
from yolov9_ddp.stream import (QUAD, SAMPLE, SeededSamples, StreamSampler, epoch_order, repeats_per_epoch, scale_draw,
                               seed_of)


def epoch_batches(num_images, batch, world, epoch, seed=0, start=0, shuffle=True, quad=False):
    """[[rank 0's keys, rank 1's, ...] for each step] of one epoch."""
    ranks = []
    for rank in range(world):
        sampler = StreamSampler(num_images, batch, rank, world, seed, shuffle, quad)
        sampler.set_epoch(epoch, start)
        ranks.append(list(sampler))
    assert len({len(r) for r in ranks}) == 1  # the same number of steps on every rank
    return [list(step) for step in zip(*ranks)]


@pytest.mark.parametrize('shuffle', [True, False])
@pytest.mark.parametrize('num_images,batch,world', [(45, 8, 2), (45, 4, 2), (45, 4, 4), (7, 3, 3), (64, 8, 8),
                                                    (13, 12, 3), (3, 6, 6)])
def test_every_image_once_per_epoch_and_repeats_only_to_fill_a_last_batch_smaller_than_the_world(num_images, batch,
                                                                                                 world, shuffle):
    for epoch in range(3):
        keys = [key for step in epoch_batches(num_images, batch, world, epoch, shuffle=shuffle)
                for share in step for key in share]
        assert {e for e, _ in keys} == {epoch}
        counts = Counter(index for _, index in keys)
        assert set(counts) == set(range(num_images))
        assert len(keys) - num_images == repeats_per_epoch(num_images, batch, world) <= world - 1


@pytest.mark.parametrize('num_images', [48, 45])
def test_global_batch_k_holds_the_same_images_on_any_number_of_processes_that_divides_it(num_images):
    """(Unless the last global batch has fewer images than processes: 45 = 3 x 12 + 9 on 12 processes.)"""
    per_world = {}
    for world in [w for w in (1, 2, 3, 4, 6, 12) if repeats_per_epoch(num_images, 12, w) == 0]:
        per_world[world] = [sorted(i for share in step for _, i in share)
                            for step in epoch_batches(num_images, 12, world, epoch=1, seed=5)]
    assert all(batches == per_world[1] for batches in per_world.values())


@pytest.mark.parametrize('world', [1, 2, 3, 4, 6])
def test_rect_global_batch_k_is_the_datasets_batch_k_on_any_number_of_processes(world):
    """--rect (shuffle=False): global batch k holds the dataset's images [12k, 12k + 12) on any number of processes,
    in every epoch (upstream's dataset, built with the global batch, gives them one shape), and every rank has the
    same number of steps. A contiguous run of per-rank batches for each rank would not do: 36 images in batches of 4
    on 2 ranks would give one 4 steps and the other 5, and the job would abort in a collective the first never
    joins."""
    for epoch in (0, 1):
        steps = epoch_batches(45, 12, world, epoch, shuffle=False)
        assert [sorted(i for share in step for _, i in share) for step in steps] == [
            list(range(first, min(first + 12, 45))) for first in range(0, 45, 12)]


@pytest.mark.parametrize('num_images,batch,world,steps', [(36, 8, 2, 4), (38, 8, 2, 4), (40, 8, 2, 5),
                                                          (45, 16, 2, 3), (37, 8, 1, 5), (35, 8, 1, 4)])
def test_quad_leaves_out_a_last_global_batch_that_gives_a_rank_fewer_than_four_images(num_images, batch, world,
                                                                                      steps):
    """upstream's collate_fn4 makes one image of each four and fails on a share of fewer (36 images, global batch
    8 on 2 processes: the last batch would give each 2); every other image trains once per epoch."""
    batches = epoch_batches(num_images, batch, world, epoch=1, quad=True)
    assert len(batches) == steps and min(len(share) for step in batches for share in step) >= QUAD
    trained = [index for step in batches for share in step for _, index in share]
    assert len(set(trained)) == len(trained) == min(num_images, steps * batch)


def test_a_start_at_step_s_yields_the_rest_of_the_epoch_unchanged():
    whole = epoch_batches(45, 8, 2, epoch=2)
    assert epoch_batches(45, 8, 2, epoch=2, start=3) == whole[3:]
    sampler = StreamSampler(45, 8, 0, 2, seed=0)
    sampler.set_epoch(2, 3)
    assert len(sampler) == len(whole) - 3 and sampler.steps == len(whole)


class Recording:
    """A dataset of 12 keys (epoch, index) that leaves a file named after each key it loads, for the test to see."""

    def __init__(self, folder):
        self.folder = folder

    def __len__(self):
        return 12

    def __getitem__(self, key):
        (self.folder / '{}-{}'.format(*key)).touch()
        return key


def epochs_loaded(folder) -> set:
    return {int(path.name.split('-')[0]) for path in folder.iterdir()}


@pytest.mark.parametrize('persistent', [True, False])
def test_persistent_workers_load_the_next_epochs_first_batches_before_it_starts(tmp_path, persistent):
    """The training batches, epoch by epoch from a start at step 1, are the stream's, with or without persistent
    workers; persistent ones have loaded some of epoch 2 when epoch 1's last batch is trained (one iterator serves
    the run), workers of one epoch only its own (each epoch's iterator starts with idle workers). Persistent ones end
    as training does."""
    sampler = StreamSampler(12, 4, 0, 1, seed=0)  # 3 steps an epoch
    loader = DataLoader(Recording(tmp_path), batch_sampler=sampler, num_workers=2, persistent_workers=persistent,
                        prefetch_factor=2, collate_fn=list)
    batches = TrainingBatches(loader, epochs=4)
    trained = [list(batches.of_epoch(1, start_step=1))]
    deadline = time.monotonic() + 10
    while persistent and 2 not in epochs_loaded(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert min(epochs_loaded(tmp_path)) == 1 and (max(epochs_loaded(tmp_path)) > 1) is persistent
    trained += [list(batches.of_epoch(epoch)) for epoch in (2, 3)]
    stream = [epoch_batches(12, 4, 1, 1, start=1), epoch_batches(12, 4, 1, 2), epoch_batches(12, 4, 1, 3)]
    assert trained == [[shares[0] for shares in epoch] for epoch in stream]
    workers = loader._iterator._workers if persistent else []
    batches.end()
    assert not any(worker.is_alive() for worker in workers)


def test_the_order_changes_every_epoch_and_repeats_with_the_seed():
    orders = [epoch_order(100, 0, epoch).tolist() for epoch in range(3)]
    assert orders[0] != orders[1] != orders[2]
    assert epoch_order(100, 0, 1).tolist() == orders[1] != epoch_order(100, 1, 1).tolist()
    assert sorted(orders[0]) == list(range(100))


def test_sample_seeds_do_not_collide_where_index_plus_seed_plus_epoch_would():
    keys = [(seed, epoch, index) for seed in range(3) for epoch in range(20) for index in range(50)]
    assert len({seed_of(SAMPLE, *key) for key in keys}) == len(keys)
    assert seed_of(SAMPLE, -1, 0, 0) != seed_of(SAMPLE, 1, 0, 0)  # a negative --seed is a seed of its own


def test_multi_scale_size_depends_on_seed_and_step_only():
    assert scale_draw(0, 17).randrange(1000) == scale_draw(0, 17).randrange(1000)
    assert len({scale_draw(0, step).randrange(10 ** 9) for step in range(50)}) == 50


class Drawing:
    """A dataset whose samples are random draws (as upstream's augmentations are) and that records mosaic."""
    mosaic = True

    def __len__(self):
        return 10

    def __getitem__(self, index):
        return index, random.random(), float(np.random.rand()), self.mosaic


def test_a_sample_draws_the_same_randomness_whenever_and_wherever_it_is_loaded():
    samples = SeededSamples(Drawing(), seed=3, mosaic_until=2)
    first = samples[(1, 4)]
    random.random(), np.random.rand(), samples[(1, 5)]  # other draws in between, as another worker's history
    assert samples[(1, 4)] == first
    assert samples[(2, 4)][1:3] != first[1:3] and SeededSamples(Drawing(), seed=4)[(1, 4)][1:3] != first[1:3]


def test_mosaic_follows_the_epoch_of_each_sample_so_close_mosaic_reaches_persistent_workers():
    samples = SeededSamples(Drawing(), seed=0, mosaic_until=2)
    assert [samples[(epoch, 0)][3] for epoch in range(4)] == [True, True, False, False]
    assert SeededSamples(Drawing(), seed=0)[(50, 0)][3] is True
