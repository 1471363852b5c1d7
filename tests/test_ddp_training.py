"""The DDP claims of ddp_train_dual.py, each shown by a real multi-process job (torchrun, gloo on CPU):
sampler coverage, DDP gradient math, EMA synchronisation and distributed validation."""
import math
from collections import Counter

import numpy as np
import pytest
import torch

from testsupport.jobs import run_probe, save_model_state, train_args
from yolov9_ddp.samplers import ShardBatchSampler, padding_per_epoch, training_sampler

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope='module')
def dataset(task_datasets):
    """45 training images (not a multiple of 5 batches of 2 ranks) and 50 validation images."""
    return task_datasets['boxes']


@pytest.fixture(scope='module')
def fitted_model(fitted):
    """The tiny dual model fitted to the validation images: weights that detect something there."""
    return fitted('detect-dual')


# -- sampler ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('num_items,world', [(45, 2), (45, 4), (7, 3), (8, 8), (3, 5)])
def test_training_sampler_draws_every_index_once_per_epoch(num_items, world):
    for epoch in range(3):
        drawn = []
        for rank in range(world):
            sampler = training_sampler(range(num_items), rank, world, seed=0)
            sampler.set_epoch(epoch)
            drawn.append(list(sampler))
        counts = Counter(i for shard in drawn for i in shard)
        assert set(counts) == set(range(num_items))
        assert sum(counts.values()) - num_items == padding_per_epoch(num_items, world) <= world - 1
        assert len({len(shard) for shard in drawn}) == 1  # same number of batches on every rank


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
        return run_probe(patched_tree, 2, 'sampler', out / f'{name}.json', args, {'epochs': 3})
    return run('a', 0), run('b', 0), run('c', 1)


@pytest.mark.slow
def test_each_training_image_is_drawn_once_per_epoch_across_ranks(sampler_runs):
    first, _, _ = sampler_runs
    files = first['ranks'][0]['files']
    for epoch in range(3):
        drawn = [p for rank in first['ranks'] for p in rank['epochs'][epoch]]
        counts = Counter(drawn)
        assert set(counts) == set(files)
        assert len(drawn) - len(files) == padding_per_epoch(len(files), 2) == 1  # 45 images on 2 ranks


@pytest.mark.cores
def test_order_changes_every_epoch_and_repeats_with_the_same_seed(sampler_runs):
    first, again, other_seed = sampler_runs
    orders = [[rank['epochs'][e] for rank in first['ranks']] for e in range(3)]
    assert orders[0] != orders[1] != orders[2]
    assert [r['epochs'] for r in first['ranks']] == [r['epochs'] for r in again['ranks']]
    assert [r['epochs'] for r in first['ranks']] != [r['epochs'] for r in other_seed['ranks']]


@pytest.mark.cores
def test_label_cache_is_built_by_rank_0_only(sampler_runs):
    first, again, _ = sampler_runs
    builds = [b for rank in first['ranks'] for b in rank['cache_builds']]
    assert sorted(builds) == sorted([[0, p] for p in {b[1] for b in builds}]) and len(builds) == 2  # train, val
    assert [b for rank in again['ranks'] for b in rank['cache_builds']] == []  # the second run reads it


# -- DDP math --------------------------------------------------------------------------------------------------------

def fixed_inputs(tree, weights, folder, duplicate_halves):
    """Initial weights (fitted ones: the loss then has positives to normalise by, see below), saved for every
    process, and one global batch of 8 images of the validation set (testsupport/probes/probe.py builds it)."""
    folder.mkdir(parents=True, exist_ok=True)
    init = save_model_state(tree, weights, folder / 'init.pt')
    return {'init': str(init), 'indices': [0, 1, 2, 3] * 2 if duplicate_halves else list(range(8))}


def step(tree, dataset, out, nproc, micro, config, name):
    args = train_args(dataset, out / name, 1, 8, 64)
    return run_probe(tree, nproc, 'step', out / f'{name}.json', args, {**config, 'micro': micro})


def assert_same_params(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    worst = max(float(np.max(np.abs(np.array(a[k]) - np.array(b[k])))) for k in a)
    assert worst <= atol, f'parameters differ by up to {worst}'


def changed(before_run, after_run):
    return any(before_run[k] != after_run[k] for k in before_run)


@pytest.mark.slow
def test_one_step_1_process_batch_b_equals_2_processes_batch_b_over_2(patched_tree, dataset, fitted_model,
                                                                      tmp_path):
    # Upstream's loss divides by the sum of target scores of the batch a process sees (at least 1), so 1 x B and
    # 2 x B/2 are the same objective only when both halves carry the same targets, and the sum exceeds 1 (hence
    # weights fitted to these images): the global batch is two copies of 4 images.
    config = fixed_inputs(patched_tree, fitted_model, tmp_path / 'in', duplicate_halves=True)
    single = step(patched_tree, dataset, tmp_path, 1, 1, config, 'single')['ranks'][0]['params']
    ddp = step(patched_tree, dataset, tmp_path, 2, 2, config, 'ddp')
    assert_same_params(ddp['ranks'][0]['params'], ddp['ranks'][1]['params'], atol=0)
    assert_same_params(single, ddp['ranks'][0]['params'])
    init = {k: v.double().flatten().tolist() for k, v in torch.load(config['init']).items() if v.is_floating_point()}
    assert changed(init, single)  # a real step was taken


@pytest.mark.slow
def test_2_processes_equal_1_process_accumulating_the_same_micro_batches(patched_tree, dataset, fitted_model,
                                                                        tmp_path):
    # 8 different images: the gradient all-reduce and the loss scaling by world size must be right for this
    # to hold (without the all-reduce, each rank would step on its own half and the ranks would disagree).
    config = fixed_inputs(patched_tree, fitted_model, tmp_path / 'in', duplicate_halves=False)
    single = step(patched_tree, dataset, tmp_path, 1, 2, config, 'single')['ranks'][0]['params']
    ddp = step(patched_tree, dataset, tmp_path, 2, 2, config, 'ddp')
    assert_same_params(ddp['ranks'][0]['params'], ddp['ranks'][1]['params'], atol=0)
    assert_same_params(single, ddp['ranks'][0]['params'])


@pytest.mark.slow
def test_accumulation_micro_steps_skip_the_gradient_all_reduce(patched_tree, dataset, fitted_model, tmp_path):
    config = fixed_inputs(patched_tree, fitted_model, tmp_path / 'in', duplicate_halves=False)
    single = step(patched_tree, dataset, tmp_path, 1, 4, config, 'single')['ranks'][0]['params']
    ddp = step(patched_tree, dataset, tmp_path, 2, 4, config, 'ddp')
    first = [rank['grads_after_first_micro_step'] for rank in ddp['ranks']]
    assert first[0] != first[1]  # after a no_sync micro-step each rank holds only its own gradients
    assert_same_params(single, ddp['ranks'][0]['params'])  # the stepping micro-step reduced the sum


# -- EMA ---------------------------------------------------------------------------------------------------------------

@pytest.mark.cores
def test_ema_is_bit_identical_on_every_rank_after_every_epoch(patched_tree, dataset, tmp_path):
    args = train_args(dataset, tmp_path / 'runs', 2, 4, 64, '--noval')
    report = run_probe(patched_tree, 2, 'ema', tmp_path / 'ema.json', args)
    per_rank = [rank['epochs'] for rank in report['ranks']]
    assert len(per_rank[0]) == len(per_rank[1]) == 2
    for epoch in range(2):
        zero, one = per_rank[0][epoch], per_rank[1][epoch]
        assert zero['ema_updates'] == one['ema_updates'] > 0
        assert zero['ema_hash'] == one['ema_hash']
        # BatchNorm statistics: each rank's own before the epoch's all_reduce, their mean after, on every rank
        assert zero['bn_before'] != one['bn_before']
        mean = (np.array(zero['bn_before'], dtype=np.float64) + np.array(one['bn_before'], dtype=np.float64)) / 2
        assert zero['bn_after'] == one['bn_after']
        np.testing.assert_allclose(zero['bn_after'], mean, rtol=0, atol=1e-6)


# -- distributed validation --------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('nproc', [2, 3])
def test_distributed_validation_equals_single_process_validation(patched_tree, dataset, fitted_model, tmp_path,
                                                                  nproc):
    # batch 8 per process: validation batches of 16, 50 images = 4 batches, split 2/2 or 1/1/2 over the ranks
    per_rank_batch = 8
    ddp = run_probe(patched_tree, nproc, 'val', tmp_path / 'ddp.json',
                    train_args(dataset, tmp_path / 'ddp', 1, per_rank_batch * nproc, 64),
                    {'weights': str(fitted_model)})
    single = run_probe(patched_tree, 1, 'val', tmp_path / 'single.json',
                       train_args(dataset, tmp_path / 'single', 1, per_rank_batch, 64),
                       {'weights': str(fitted_model)})
    reference = single['ranks'][0]['results'][:4]
    assert reference[2] > 0, 'the fitted weights must detect something, or the comparison proves nothing'
    assert sum(rank['shard_batches'] for rank in ddp['ranks']) == math.ceil(50 / (2 * per_rank_batch))
    upstream = single['ranks'][0]['upstream_results'][:4]  # val_dual.run with upstream's own dataloader
    np.testing.assert_allclose(reference, upstream, rtol=0, atol=1e-6)
    for rank in ddp['ranks']:  # P, R, mAP50, mAP50-95 on every rank
        np.testing.assert_allclose(rank['results'][:4], reference, rtol=0, atol=1e-6)
        np.testing.assert_allclose(rank['maps'], single['ranks'][0]['maps'], rtol=0, atol=1e-6)
