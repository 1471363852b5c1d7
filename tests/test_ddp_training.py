"""The samplers of ddp_train_dual.py in a real job: every training image once per epoch across ranks (the stream's
unit tests are tests/test_stream.py), an order that changes every epoch and repeats with the seed, the label cache
built by rank 0 alone, validation shards that are contiguous and unpadded. The DDP step, EMA synchronisation and
distributed validation of every entry point, this one included, are in tests/test_tasks.py."""
from collections import Counter

import pytest

from testsupport.jobs import run_probe, train_args
from yolov9_ddp.samplers import ShardBatchSampler
from yolov9_ddp.stream import repeats_per_epoch

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope='module')
def dataset(task_datasets):
    """45 training images (not a multiple of 5 batches of 2 ranks) and 50 validation images."""
    return task_datasets['boxes']


# -- sampler ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('num_items,batch,world', [(50, 8, 3), (50, 8, 2), (16, 8, 3), (5, 2, 1), (64, 8, 8)])
def test_shard_batch_sampler_is_contiguous_unpadded_and_batch_aligned(num_items, batch, world):
    shards = [list(ShardBatchSampler(num_items, batch, rank, world)) for rank in range(world)]
    flat = [i for shard in shards for b in shard for i in b]
    assert flat == list(range(num_items))  # every image once, in single-process order
    single = list(ShardBatchSampler(num_items, batch, 0, 1))
    assert [b for shard in shards for b in shard] == single  # the very batches one process builds
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


@pytest.fixture(scope='module')
def sampler_runs(patched_tree, dataset, tmp_path_factory):
    """The training loader of 2 ranks over 3 epochs, twice with seed 0 and once with seed 1."""
    out = tmp_path_factory.mktemp('sampler')
    for cache in dataset.parent.glob('labels/*.cache'):
        cache.unlink()  # so the probe shows who builds it

    def run(name, seed):
        args = train_args(dataset, out / name, 3, 4, 64, '--seed', seed)
        return [rank['sampler'] for rank in run_probe(patched_tree, 2, 'sampler', out / f'{name}.json', args,
                                                      {'epochs': 3})]
    return run('a', 0), run('b', 0), run('c', 1)


@pytest.mark.slow
def test_each_training_image_is_drawn_once_per_epoch_across_ranks(sampler_runs):
    first, _, _ = sampler_runs
    files = first[0]['files']
    for epoch in range(3):
        drawn = [p for rank in first for p in rank['epochs'][epoch]]
        counts = Counter(drawn)
        assert set(counts) == set(files)
        assert len(drawn) - len(files) == repeats_per_epoch(len(files), 4, 2) == 1  # 45 = 11 x 4 + 1 on 2 ranks


@pytest.mark.cores
def test_order_changes_every_epoch_and_repeats_with_the_same_seed(sampler_runs):
    first, again, other_seed = sampler_runs
    orders = [[rank['epochs'][e] for rank in first] for e in range(3)]
    assert orders[0] != orders[1] != orders[2]
    assert [r['epochs'] for r in first] == [r['epochs'] for r in again]
    assert [r['epochs'] for r in first] != [r['epochs'] for r in other_seed]


@pytest.mark.cores
def test_label_cache_is_built_by_rank_0_only(sampler_runs):
    first, again, _ = sampler_runs
    builds = [b for rank in first for b in rank['cache_builds']]
    assert sorted(builds) == sorted([[0, p] for p in {b[1] for b in builds}]) and len(builds) == 2  # train, val
    assert [b for rank in again for b in rank['cache_builds']] == []  # the second run reads it
