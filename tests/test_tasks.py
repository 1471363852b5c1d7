"""Every kit entry point keeps the guarantees of ddp_train_dual.py for its task (yolov9_ddp.tasks): ddp_train.py
(GELAN, for train.py), ddp_train_triple.py, segment/ddp_train.py and segment/ddp_train_dual.py. Each claim is shown
by real jobs (gloo on CPU) of the task's tiny model, the same kinds of jobs that tests/test_ddp_training.py,
test_ddp_resume.py and test_faults.py run in more depth for ddp_train_dual.py, whose loop is the same code:

  - the DDP step equals one process's step on the same global batch (masks too)
  - EMA and BatchNorm statistics bit-identical on every rank after every epoch
  - distributed validation equals one process's (segmentation: box and mask metrics) and upstream's own
  - a killed rank: torchrun restarts, the run resumes from its atomic checkpoint and completes
  - SIGTERM: every rank stops after the same step, a resumable last.pt, --resume completes
  - a model of another task is refused in one line naming the entry point that trains it
  - segmentation: every image drawn once per epoch; training survives a rank whose batch has no masks
"""
import math
import signal
import sys

import numpy as np
import pytest

from testsupport.faults import completed_run_problems, kill_scenario, signal_scenario
from testsupport.jobs import (TASK_DATASETS, labels_of, run, run_probe, save_model_state, task_cfg, torchrun_cmd,
                              train_args)
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset
from yolov9_ddp.samplers import padding_per_epoch
from yolov9_ddp.tasks import TASKS

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures('upstream_importable')]
NEW_TASKS = [name for name in TASKS if name != 'detect-dual']  # detect-dual: the tests named above


def probe(tree, task, nproc, mode, out, args, config):
    return run_probe(tree, nproc, mode, out, args, {**config, 'task': task})


# -- the DDP step, EMA, validation -------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('task', NEW_TASKS)
def test_the_ddp_step_equals_one_process_accumulating_the_same_micro_batches(patched_tree, task_datasets, fitted,
                                                                            tmp_path, task):
    init = save_model_state(patched_tree, fitted(task), tmp_path / 'init.pt')
    config = {'init': str(init), 'indices': list(range(8)), 'micro': 2}
    data, cfg = task_datasets[labels_of(task)], task_cfg(task)
    single = probe(patched_tree, task, 1, 'step', tmp_path / 'single.json',
                   train_args(data, tmp_path / 'single', 1, 8, 64, cfg=cfg), config)['ranks'][0]['params']
    ddp = probe(patched_tree, task, 2, 'step', tmp_path / 'ddp.json',
                train_args(data, tmp_path / 'ddp', 1, 8, 64, cfg=cfg), config)
    zero, one = (rank['params'] for rank in ddp['ranks'])
    assert zero == one
    worst = max(float(np.max(np.abs(np.array(single[k]) - np.array(zero[k])))) for k in single)
    assert worst <= 1e-6, f'parameters differ by up to {worst}'


@pytest.mark.slow
@pytest.mark.parametrize('task', NEW_TASKS)
def test_ema_and_batchnorm_statistics_are_identical_on_every_rank(patched_tree, task_datasets, tmp_path, task):
    args = train_args(task_datasets[labels_of(task)], tmp_path / 'runs', 2, 4, 64, '--noval', cfg=task_cfg(task))
    per_rank = [rank['epochs'] for rank in probe(patched_tree, task, 2, 'ema', tmp_path / 'ema.json', args,
                                                 {})['ranks']]
    assert len(per_rank[0]) == len(per_rank[1]) == 2
    for zero, one in zip(*per_rank):
        assert zero['ema_updates'] == one['ema_updates'] > 0 and zero['ema_hash'] == one['ema_hash']
        assert zero['bn_before'] != one['bn_before'] and zero['bn_after'] == one['bn_after']


@pytest.mark.slow
@pytest.mark.parametrize('task', NEW_TASKS)
def test_distributed_validation_equals_one_process_and_upstream(patched_tree, task_datasets, fitted, tmp_path, task):
    data, cfg, weights = task_datasets[labels_of(task)], task_cfg(task), {'weights': str(fitted(task))}
    ddp = probe(patched_tree, task, 2, 'val', tmp_path / 'ddp.json', train_args(data, tmp_path / 'd', 1, 16, 64,
                                                                                cfg=cfg), weights)
    single = probe(patched_tree, task, 1, 'val', tmp_path / 'single.json',
                   train_args(data, tmp_path / 's', 1, 8, 64, cfg=cfg), weights)['ranks'][0]
    metrics = len(TASKS[task].metric_names)  # P, R, mAP50, mAP50-95 (of boxes, then of masks)
    reference = single['results'][:metrics]
    assert reference[2] > 0, 'the fitted weights must find something, or the comparison proves nothing'
    if TASKS[task].masks:
        assert reference[6] > 0, 'the fitted weights must segment something'
    np.testing.assert_allclose(reference, single['upstream_results'][:metrics], rtol=0, atol=1e-6)
    val_images = TASK_DATASETS[labels_of(task)].val
    assert sum(rank['shard_batches'] for rank in ddp['ranks']) == math.ceil(val_images / 16)
    for rank in ddp['ranks']:
        np.testing.assert_allclose(rank['results'][:metrics], reference, rtol=0, atol=1e-6)
        np.testing.assert_allclose(rank['maps'], single['maps'], rtol=0, atol=1e-6)


# -- faults, signals, resume -------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('task', NEW_TASKS)
def test_a_killed_rank_is_restarted_and_the_run_completes(patched_tree, task_datasets, tmp_path, task):
    outcome = kill_scenario(patched_tree, task_datasets[labels_of(task)], tmp_path,
                            'kill:rank=1:where=step:epoch=1:step=3', task=task)
    assert not outcome.problems, outcome.describe()
    assert outcome.redone == [1], outcome.describe()


@pytest.mark.slow
@pytest.mark.parametrize('task', NEW_TASKS)
def test_sigterm_stops_every_rank_with_a_resumable_checkpoint(patched_tree, task_datasets, tmp_path, task):
    outcome = signal_scenario(patched_tree, task_datasets[labels_of(task)], tmp_path, signal.SIGTERM, task=task)
    assert not outcome.problems, outcome.describe()
    assert outcome.detail['saved_epoch'] == 0 and outcome.redone == [1], outcome.describe()


# -- clear errors ------------------------------------------------------------------------------------------------------

WRONG_MODELS = {'detect': 'detect-dual', 'detect-triple': 'detect', 'segment': 'segment-dual',
                'segment-dual': 'detect-dual', 'detect-dual': 'segment'}


@pytest.mark.slow
@pytest.mark.parametrize('task', list(TASKS))
def test_a_model_of_another_task_is_refused_before_the_data_is_read(patched_tree, task_datasets, tmp_path, task):
    other = TASKS[WRONG_MODELS[task]]
    args = train_args(task_datasets[labels_of(task)], tmp_path / 'runs', 1, 4, 64, cfg=task_cfg(other.name))
    result = run([sys.executable, TASKS[task].script, *map(str, args)], patched_tree, timeout=300)
    errors = [line for line in result.stderr.splitlines() if ': error' in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f'{TASKS[task].script}: error: ') and f'train it with {other.script}' in errors[0]
    assert 'Scanning' not in result.stdout + result.stderr and 'Traceback' not in result.stderr


# -- segmentation ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_segmentation_draws_every_training_image_once_per_epoch(patched_tree, task_datasets, tmp_path):
    args = train_args(task_datasets['polygons'], tmp_path / 'runs', 2, 4, 64, cfg=task_cfg('segment'))
    report = probe(patched_tree, 'segment', 2, 'sampler', tmp_path / 'sampler.json', args, {'epochs': 2})
    files = report['ranks'][0]['files']
    for epoch in range(2):
        drawn = [p for rank in report['ranks'] for p in rank['epochs'][epoch]]
        assert set(drawn) == set(files) and len(drawn) - len(files) == padding_per_epoch(len(files), 2)


@pytest.mark.slow
@pytest.mark.parametrize('task', ['segment', 'segment-dual'])
def test_segmentation_trains_when_a_rank_has_a_batch_without_masks(patched_tree, tmp_path, task):
    """yolov9#559: upstream's segmentation under DDP failed with 'Expected to have finished reduction in the prior
    iteration' once a rank's batch had no masks (the mask prototypes then got no gradient). Here 1 of 16 training
    images has labels and mosaic is off, so most batches of one image per rank have none."""
    data = ensure_demo_dataset(tmp_path / 'sparse', DemoSpec(train=16, val=8, imgsz=64, labels='polygons'))
    labels = sorted((data.parent / 'labels' / 'train').glob('*.txt'))
    for label in labels[1:]:
        label.write_text('')
    hyp = tmp_path / 'hyp.yaml'
    hyp.write_text((patched_tree / 'data' / 'hyps' / 'hyp.scratch-high.yaml').read_text()
                   .replace('mosaic: 1.0', 'mosaic: 0.0'))
    args = train_args(data, tmp_path / 'runs', 2, 2, 64, '--hyp', hyp, cfg=task_cfg(task))
    result = run(torchrun_cmd(2, TASKS[task].script, *args), patched_tree, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    problems = completed_run_problems(tmp_path / 'runs', 2, task)
    assert not problems, problems


# -- which entry point trains which model (fast) -------------------------------------------------------------------------

def test_every_upstream_model_config_has_exactly_one_way_to_train_it(pinned_upstream):
    from yolov9_ddp.tasks import UPSTREAM_ONLY
    from yolov9_ddp.trainer import head_of
    configs = [cfg for family in ('detect', 'segment', 'panoptic')  # models/hub holds YOLOv3 leftovers
               for cfg in sorted((pinned_upstream / 'models' / family).glob('*.yaml'))]
    assert len(configs) == 20
    for cfg in configs:
        head = head_of(cfg)
        claims = [task.script for task in TASKS.values() if head in task.heads]
        assert len(claims) + (head in UPSTREAM_ONLY) == 1, f'{cfg.name} ends in {head}: {claims}'
        for task in TASKS.values():
            assert (task.wrong_entry_point(head) is None) == (task.script in claims)


def test_the_refusal_names_the_entry_point_and_the_upstream_script():
    assert TASKS['detect-dual'].wrong_entry_point('DDetect') == (
        'ddp_train_dual.py trains models ending in DualDetect or DualDDetect; this model ends in DDetect: '
        "train it with ddp_train.py (for upstream's train.py)")
    assert TASKS['segment'].wrong_entry_point('Panoptic').endswith("train it with upstream's panoptic/train.py "
                                                                    '(one process)')
    assert TASKS['detect'].wrong_entry_point('Nonsense').endswith('no training script of YOLOv9 knows that head')


def test_final_checkpoints_are_named_as_the_upstream_script_names_them(tmp_path):
    last = tmp_path / 'weights' / 'last.pt'
    assert TASKS['detect'].stripped(last) == tmp_path / 'weights' / 'last_striped.pt'  # train.py
    for name in ('detect-dual', 'detect-triple', 'segment', 'segment-dual'):
        assert TASKS[name].stripped(last) == last
