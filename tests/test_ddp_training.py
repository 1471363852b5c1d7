"""The samplers of ddp_train_dual.py in a real job: every training image once per epoch across ranks (the stream's unit
tests are tests/test_stream.py), an order that changes every epoch and repeats with the seed, the label cache built
by rank 0 alone, validation shards that are contiguous and unpadded; and every training flag of train_dual.py trains
on 2 processes. The DDP step, EMA synchronisation and distributed validation of every entry point, this one included,
are in tests/test_tasks.py."""
from collections import Counter

import pytest

from testsupport.faults import completed_run_problems
from testsupport.jobs import copy_dataset, run, run_probe, torchrun_cmd, train_args
from testsupport.trees import describe
from yolov9_ddp.samplers import ShardBatchSampler
from yolov9_ddp.stream import epoch_order, rank_share, repeats_per_epoch, steps_per_epoch

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


SEED, BATCH, WORLD, EPOCHS = 1, 4, 2, 3


@pytest.fixture(scope='module')
def sampler_run(patched_tree, dataset, tmp_path_factory):
    """What the training loader of 2 ranks yields over 3 epochs with --seed 1, from a fresh label cache. That a
    second run reads the cache is test_faults' two-node job's assertion; that the order is a function of (seed,
    epoch) alone, test_stream's: here the job's order is compared with that function's."""
    out = tmp_path_factory.mktemp('sampler')
    data = copy_dataset(dataset, out / 'data')  # no cache, and none a test beside it builds: the probe shows who does
    args = train_args(data, out / 'run', EPOCHS, BATCH, 64, '--seed', SEED)
    return [rank['sampler'] for rank in run_probe(patched_tree, WORLD, 'sampler', out / 'run.json', args,
                                                  {'epochs': EPOCHS})]


def stream_order(files: list, seed: int, epoch: int, rank: int) -> list:
    """The images rank trains in epoch, by yolov9_ddp.stream's functions."""
    order = epoch_order(len(files), seed, epoch)
    return [files[order[p % len(files)]] for step in range(steps_per_epoch(len(files), BATCH))
            for p in rank_share(len(files), BATCH, step, rank, WORLD)]


@pytest.mark.slow
def test_each_training_image_is_drawn_once_per_epoch_across_ranks(sampler_run):
    files = sampler_run[0]['files']
    for epoch in range(EPOCHS):
        drawn = [p for rank in sampler_run for p in rank['epochs'][epoch]]
        counts = Counter(drawn)
        assert set(counts) == set(files)
        assert len(drawn) - len(files) == repeats_per_epoch(len(files), BATCH, WORLD) == 1  # 45 = 11 x 4 + 1


@pytest.mark.slow
def test_the_objects_of_the_set_up_are_left_out_of_garbage_collection(sampler_run):
    """A full collection visits only what training makes (trainer.freeze_long_lived_objects)."""
    for rank in sampler_run:
        assert rank['objects']['frozen'] > 10 * rank['objects']['tracked'], rank['objects']


@pytest.mark.slow
def test_order_changes_every_epoch_and_follows_the_seed(sampler_run):
    files = sampler_run[0]['files']
    drawn = [[rank['epochs'][epoch] for rank in sampler_run] for epoch in range(EPOCHS)]
    assert drawn[0] != drawn[1] != drawn[2]
    assert drawn == [[stream_order(files, SEED, e, r) for r in range(WORLD)] for e in range(EPOCHS)]
    assert drawn != [[stream_order(files, 0, e, r) for r in range(WORLD)] for e in range(EPOCHS)]  # not a fixed seed


@pytest.mark.slow
def test_label_cache_is_built_by_rank_0_only(sampler_run):
    builds = [b for rank in sampler_run for b in rank['cache_builds']]
    assert sorted(builds) == sorted([[0, p] for p in {b[1] for b in builds}]) and len(builds) == 2  # train, val


# -- every training flag of train_dual.py, trained on 2 processes ---------------------------------------------------

# test_ddp_cli proves they parse as upstream's; here each set trains both epochs to a completed run. --rect and
# --quad need the split right on 2 processes: ranks with unequal numbers of batches abort in a collective, and
# --quad's collate_fn4 makes no image of a share under 4 (45 images, global batch 8: a last batch of 5).
# --sync-bn is CUDA's only (the kit leaves it off on CPUs).
FLAG_SETS = {
    'quad': ['--quad', '--freeze', 1, '--cos-lr', '--label-smoothing', 0.1, '--close-mosaic', 1, '--min-items', 1,
             '--single-cls', '--optimizer', 'Adam', '--patience', 3, '--sync-bn'],
    'multi-scale': ['--multi-scale', '--flat-cos-lr', '--optimizer', 'LION', '--noautoanchor', '--nosave'],
    'rect': ['--rect', '--fixed-lr', '--optimizer', 'AdamW', '--noval', '--seed', 3],
}


@pytest.mark.slow
@pytest.mark.usefixtures('upstream_importable')  # the checkpoints pickle upstream's classes
@pytest.mark.parametrize('flags', FLAG_SETS.values(), ids=FLAG_SETS)
def test_every_training_flag_trains_on_2_processes(patched_tree, dataset, tmp_path, flags):
    project = tmp_path / 'runs'
    result = run(torchrun_cmd(2, 'ddp_train_dual.py', *train_args(dataset, project, 2, 8, 64, *flags)), patched_tree)
    assert result.returncode == 0, describe(result)
    assert completed_run_problems(project, 2) == []
