"""Distributed validation (patch 0009) for every validation script a training script calls: val.py, val_dual.py,
val_triple.py, segment/val.py and segment/val_dual.py. With run(..., distributed=True) each rank validates its
contiguous shard of whole batches (the kit's ShardBatchSampler) and every rank must get the metrics, per-class
mAPs and mean losses one process gets over the whole set, to 1e-6 (segmentation: box and mask metrics).

The model is the kit's tiny config for the task, fitted to the validation images of its dataset (the session's
`fitted` fixture), so that the metrics compared are not all zero.
"""
import json
import math

import pytest

from testsupport.jobs import TASK_DATASETS, labels_of, run_distributed_val
from yolov9_ddp.tasks import TASKS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]



def three_batches(task: str) -> int:
    """The batch size that splits the task's validation set into 3 batches, the last one smaller: 2 ranks then get
    1 and 2 batches, 3 ranks 1 each."""
    return math.ceil(TASK_DATASETS[labels_of(task)].val / 3)


def validate(tree, task, weights, data, nproc, out):
    run_distributed_val(tree, nproc, 'val', task, weights, data, out, three_batches(task))
    report = json.loads(out.read_text())
    assert report['world'] == nproc and len(report['ranks']) == nproc
    return report['ranks']


@pytest.fixture(scope='module')
def one_process(patched_tree, task_datasets, fitted, tmp_path_factory):
    """one_process(task): (fitted weights, what one process validating the whole set reports), once per task."""
    reports = {}

    def validate_once(task):
        if task not in reports:
            weights = fitted(task)
            out = tmp_path_factory.mktemp(f'one-{task}') / 'single.json'
            [reports[task]] = validate(patched_tree, task, weights, task_datasets[labels_of(task)], 1, out)
        return fitted(task), reports[task]

    return validate_once


def results_names(task):
    boxes = ['P', 'R', 'mAP50', 'mAP50-95']
    metrics = boxes + [f'mask {name}' for name in boxes] if TASKS[task].masks else boxes
    losses = len(TASKS[task].loss_names)
    return metrics + [f'loss {i}' for i in range(losses)]


@pytest.mark.parametrize('task, nproc', [('detect', 2), ('detect', 3), ('detect-dual', 2), ('detect-triple', 2),
                                         ('segment', 2), ('segment', 3), ('segment-dual', 2)])
def test_distributed_validation_equals_one_process(patched_tree, task_datasets, one_process, task, nproc, tmp_path):
    weights, single = one_process(task)
    names = results_names(task)
    assert len(single['results']) == len(names) and single['batches'] == 3
    measured = dict(zip(names, single['results']))
    assert measured['mAP50'] > 0, f'the fitted model detects nothing: {measured}'
    if TASKS[task].masks:
        assert measured['mask mAP50'] > 0, f'the fitted model segments nothing: {measured}'

    data = task_datasets[labels_of(task)]
    ranks = validate(patched_tree, task, weights, data, nproc, tmp_path / f'ranks-{nproc}.json')
    assert [rank['batches'] for rank in ranks] == ([1, 2] if nproc == 2 else [1, 1, 1])
    for rank, observed in enumerate(ranks):
        for name, one, many in zip(names, single['results'], observed['results']):
            assert many == pytest.approx(one, abs=1e-6), f'rank {rank}: {name} {many} != one process {one}'
        assert observed['maps'] == pytest.approx(single['maps'], abs=1e-6), f'rank {rank}: per-class mAP'
    if not TASKS[task].masks:  # the matrix rank 0 plots (handed to on_val_end) is the whole set's
        assert ranks[0]['confusion'] == single['confusion'] and sum(map(sum, single['confusion'])) > 0
