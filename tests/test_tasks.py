"""Every kit entry point keeps the guarantees of ddp_train_dual.py for its task (yolov9_ddp.tasks): ddp_train.py
(GELAN, for train.py), ddp_train_triple.py, segment/ddp_train.py and segment/ddp_train_dual.py. Each claim is shown
by real jobs (gloo on CPU) of the task's tiny model, the same kinds of jobs that tests/test_ddp_training.py,
test_ddp_resume.py and test_faults.py run in more depth for ddp_train_dual.py, whose loop is the same code. The
first three claims hold for ddp_train_dual.py too, and one job of 1, 2 (and 3) processes per task serves them:

  - the DDP step equals one process's step on the same global batch (masks too), accumulation included
  - EMA and BatchNorm statistics bit-identical on every rank after every epoch
  - distributed validation equals one process's (segmentation: box and mask metrics) and upstream's own, and so
    does upstream's val script run with distributed=True (patch 0009)
  - a killed rank: torchrun restarts, the run resumes from its atomic checkpoint and completes
  - SIGTERM: every rank stops after the same step, a resumable last.pt, --resume completes
  - with --deterministic, the run so killed, stopped and resumed ends bit-identical to the same run uninterrupted
    (one job per task serves the last three: the kill in epoch 1, SIGTERM in epoch 2 of the restarted job)
  - a model of another task is refused in one line naming the entry point that trains it
  - segmentation: every image drawn once per epoch; training survives a rank whose batch has no masks
"""
import contextlib
import math
import re
import signal
import subprocess
import sys
import tempfile
from concurrent import futures

import numpy as np
import pytest

from testsupport import zygote
from testsupport.faults import (completed_run_problems, differences, final_state, scenario_args, signal_scenario,
                               start_job)
from testsupport.jobs import TASK_DATASETS, job_env, labels_of, run, run_probe, task_cfg, torchrun_cmd, train_args
from testsupport.injected import Fault
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset
from yolov9_ddp.stream import repeats_per_epoch
from yolov9_ddp.tasks import TASKS

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures('upstream_importable')]
NEW_TASKS = [name for name in TASKS if name != 'detect-dual']  # detect-dual: the tests named above


def probe(tree, task, nproc, modes, out, args, config):
    return run_probe(tree, nproc, modes, out, args, {**config, 'task': task})


# -- the DDP step, EMA, validation: one job of 1, 2 (and 3) processes per task serves them all -----------------------

STEP_INDICES = {'halves': [0, 1, 2, 3] * 2, 'pairs': list(range(8)), 'quarters': list(range(8))}
# micro-batches of the global batch of 8 images, for 1 process and for 2
STEP_MICRO = {'halves': {1: 1, 2: 2}, 'pairs': {1: 2, 2: 2}, 'quarters': {1: 4, 2: 4}}
THREE_PROCESSES = ('detect', 'detect-dual', 'segment')  # 3 ranks: 1 validation batch each, the shards of odd W


def upstream_val_batch(task: str) -> int:
    """The batch size that cuts the task's validation set into 3 batches, the last one smaller: 2 ranks then get
    1 and 2 of them, 3 ranks 1 each."""
    return math.ceil(TASK_DATASETS[labels_of(task)].val / 3)


@pytest.fixture(scope='module')
def probed(patched_tree, task_datasets, tmp_path_factory):
    """probed(task, nproc): what each rank of one job of the task's tiny model observed (testsupport/probes/
    probe.py), with 8 images per process: validation of fitted weights by the kit and by upstream's own script
    (patch 0009), steps from them on fixed batches, and (2 processes) two epochs of EMA and BatchNorm sync, and
    (segment) the images each rank draws in two epochs. The job of 1 process first fits the weights (probe.py's
    fit: the task's tiny model fitted to the validation images, so that the loss has positives to normalise by
    and the metrics are not all zero), which the task's other jobs then read. A one-process job uses one of the 2
    cores: the next task's runs beside it, and a multi-process job starts once both have ended."""
    jobs, one_process, fitted, tasks = {}, {}, {}, list(TASKS)
    one_process_pool = futures.ThreadPoolExecutor(2)

    def job(task, nproc):
        folder = tmp_path_factory.mktemp(f'{task}-x{nproc}')
        steps = {name: {'indices': STEP_INDICES[name], 'micro': micro[nproc]} for name, micro in STEP_MICRO.items()
                 if nproc in micro}
        config = {'weights': str(fitted[task]), 'cfg': str(task_cfg(task)), 'steps': steps, 'epochs': 2,
                  'upstream_val_batch': upstream_val_batch(task)}
        modes = {1: 'fit,val,upstream_val,steps', 2: 'val,upstream_val,steps,ema', 3: 'val,upstream_val'}[nproc]
        modes += ',sampler' if (task, nproc) == ('segment', 2) else ''
        args = train_args(task_datasets[labels_of(task)], folder / 'runs', 2, 8 * nproc, 64, '--noval',
                          cfg=task_cfg(task))
        return probe(patched_tree, task, nproc, modes, folder / 'out.json', args, config)

    def one_process_job(task):
        zygote.zygote(job_env())  # started before two threads may ask for it
        fitted[task] = tmp_path_factory.mktemp(f'{task}-fit') / 'fitted.pt'
        one_process[task] = one_process_pool.submit(job, task, 1)

    def run_job(task, nproc):
        if task not in one_process:
            one_process_job(task)
            beside = [other for other in tasks[tasks.index(task) + 1:] if other not in one_process]
            if beside:
                one_process_job(beside[0])
        fit = one_process[task]
        if nproc > 1 and (task, nproc) not in jobs:
            futures.wait(one_process.values())  # the cores are free again
            fit.result()  # it fitted the weights
            jobs[task, nproc] = job(task, nproc)
        return fit.result() if nproc == 1 else jobs[task, nproc]

    yield run_job
    one_process_pool.shutdown(cancel_futures=True)


def params_after(rank: dict, name: str) -> dict:
    """{parameter: float64 tensor} after the step `name` of the rank (probe.py's steps write them to a file)."""
    import torch
    return torch.load(rank['steps'][name]['params'], weights_only=True)[name]


def assert_same_params(a: dict, b: dict, atol=1e-6):
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, f'parameters differ by up to {worst}'


@pytest.mark.slow
@pytest.mark.parametrize('task', TASKS)
def test_the_ddp_step_equals_one_process_on_the_same_global_batch(probed, task):
    """Upstream's loss divides by the sum of target scores of the batch a process sees (at least 1), so 1 x B and
    2 x B/2 are the same objective only when both halves carry the same targets and the sum exceeds 1 (hence
    weights fitted to these images): 'halves' is two copies of 4 images. With 8 different images ('pairs',
    'quarters'), the 2 processes equal 1 process accumulating the same micro-batches: the gradient all-reduce and
    the loss scaling by world size must be right for this to hold."""
    [single], ddp = probed(task, 1), probed(task, 2)
    assert single['steps']['halves']['moved'] > 0  # a real step was taken
    for name in STEP_INDICES:
        zero, one = (params_after(rank, name) for rank in ddp)
        assert_same_params(zero, one, atol=0)
        assert_same_params(params_after(single, name), zero)
    # accumulation: after a no_sync micro-step each rank holds only its own gradients; the stepping one reduced
    quarters = [rank['steps']['quarters']['grads_after_first_micro_step'] for rank in ddp]
    assert quarters[0] != quarters[1]


@pytest.mark.slow
@pytest.mark.parametrize('task', TASKS)
def test_ema_and_batchnorm_statistics_are_identical_on_every_rank_after_every_epoch(probed, task):
    per_rank = [rank['ema']['epochs'] for rank in probed(task, 2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 2
    for zero, one in zip(*per_rank):
        assert zero['ema_updates'] == one['ema_updates'] > 0 and zero['ema_hash'] == one['ema_hash']
        # BatchNorm statistics: each rank's own before the epoch's all_reduce, their mean after, on every rank
        assert zero['bn_before'] != one['bn_before'] and zero['bn_after'] == one['bn_after']
        mean = (np.array(zero['bn_before'], dtype=np.float64) + np.array(one['bn_before'], dtype=np.float64)) / 2
        np.testing.assert_allclose(zero['bn_after'], mean, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('task, nproc', [(task, 2) for task in TASKS] + [(task, 3) for task in THREE_PROCESSES])
def test_distributed_validation_equals_one_process_and_upstream(probed, task, nproc):
    """The kit's validation (a contiguous, unpadded shard of whole batches per rank) gives every rank the metrics,
    per-class mAPs and mean losses of one process over the whole set, which equal those of upstream's own script
    and dataloader; so does upstream's script itself run with distributed=True (patch 0009)."""
    [single], ranks = probed(task, 1), probed(task, nproc)
    metrics = len(TASKS[task].metric_names)  # P, R, mAP50, mAP50-95 (of boxes, then of masks)
    reference = single['val']['results'][:metrics]
    assert reference[2] > 0, 'the fitted weights must find something, or the comparison proves nothing'
    if TASKS[task].masks:
        assert reference[6] > 0, 'the fitted weights must segment something'
    np.testing.assert_allclose(reference, single['val']['upstream_results'][:metrics], rtol=0, atol=1e-6)
    val_images = TASK_DATASETS[labels_of(task)].val
    assert sum(rank['val']['shard_batches'] for rank in ranks) == math.ceil(val_images / (8 * 2))
    for rank in ranks:
        np.testing.assert_allclose(rank['val']['results'][:metrics], reference, rtol=0, atol=1e-6)
        np.testing.assert_allclose(rank['val']['maps'], single['val']['maps'], rtol=0, atol=1e-6)

    upstream = single['upstream_val']
    assert upstream['batches'] == 3 and len(upstream['results']) == metrics + len(TASKS[task].loss_names)
    assert upstream['results'][2] > 0
    assert [rank['upstream_val']['batches'] for rank in ranks] == ([1, 2] if nproc == 2 else [1, 1, 1])
    for rank in ranks:
        np.testing.assert_allclose(rank['upstream_val']['results'], upstream['results'], rtol=0, atol=1e-6)
        np.testing.assert_allclose(rank['upstream_val']['maps'], upstream['maps'], rtol=0, atol=1e-6)
    if not TASKS[task].masks:  # the matrix rank 0 plots (handed to on_val_end) is the whole set's
        confusion = upstream['confusion']
        assert ranks[0]['upstream_val']['confusion'] == confusion and sum(map(sum, confusion)) > 0


# -- faults, signals, resume -------------------------------------------------------------------------------------------

SAME_RUN = ('--deterministic', '--save-period', 1)  # the run's numerics fixed, its last epoch's full checkpoint kept


@pytest.fixture(scope='module')
def killed_then_stopped(patched_tree, task_datasets, tmp_path_factory):
    """killed_then_stopped(task): (outcome, reference) of one job of the task for three proofs (testsupport.faults.
    signal_scenario with a kill, --deterministic): rank 1 SIGKILLed mid-epoch 1, torchrun's restart continuing the
    run, SIGTERM mid-epoch 2, --resume inside that epoch; and the final state of the same training uninterrupted."""
    outcomes = {}

    def scenario(task):
        if task not in outcomes:
            data, workdir = task_datasets[labels_of(task)], tmp_path_factory.mktemp(f'faults-{task}')
            outcome = signal_scenario(patched_tree, data, workdir, signal.SIGTERM, epochs=3, task=task,
                                      kill=Fault('kill', rank=1, epoch=1, step=3), extra=SAME_RUN)
            project = tmp_path_factory.mktemp(f'reference-{task}') / 'runs'
            reference = start_job(torchrun_cmd(2, TASKS[task].script, *scenario_args(data, project, 3, task=task,
                                                                                     extra=SAME_RUN)),
                                  patched_tree, project.parent, 'reference')
            assert reference.wait(300) == 0, reference.output()[-4000:]
            outcomes[task] = outcome, final_state(project / 'exp', 3)
        return outcomes[task]
    return scenario


@pytest.mark.slow
@pytest.mark.parametrize('task', NEW_TASKS)
def test_a_killed_rank_is_restarted_and_the_run_completes(killed_then_stopped, task):
    outcome, _ = killed_then_stopped(task)
    assert not outcome.problems, outcome.describe()  # the kill fired, torchrun restarted, the run completed
    assert outcome.redone[0] == 1, outcome.describe()


@pytest.mark.slow
@pytest.mark.parametrize('task', NEW_TASKS)
def test_sigterm_stops_every_rank_with_a_resumable_checkpoint(killed_then_stopped, task):
    outcome, _ = killed_then_stopped(task)
    assert not outcome.problems, outcome.describe()
    assert outcome.detail['saved_epoch'] == outcome.detail['signalled_epoch'] - 1, outcome.describe()
    assert outcome.redone == [1, 1], outcome.describe()


@pytest.mark.slow
@pytest.mark.parametrize('task', NEW_TASKS)
def test_the_killed_stopped_and_resumed_run_ends_bit_identical_to_its_uninterrupted_run(killed_then_stopped, task):
    """The dataset classes (masks too) and losses of each task keep the same run (test_same_run.py for
    ddp_train_dual.py): the restart after the kill trains epoch 1 again from its start, the resume continues epoch 2
    at its step."""
    outcome, reference = killed_then_stopped(task)
    assert not outcome.problems, outcome.describe()
    resumed = re.findall(r'resuming epoch 2 at step (\d+) of (\d+) from', outcome.jobs[-1].output())
    assert len(resumed) == 1 and 0 < int(resumed[0][0]) < int(resumed[0][1]), outcome.jobs[-1].output()[-3000:]
    assert differences(final_state(outcome.project / 'exp', 3), reference) == []


# -- clear errors ------------------------------------------------------------------------------------------------------

WRONG_MODELS = {'detect': 'detect-dual', 'detect-triple': 'detect', 'segment': 'segment-dual',
                'segment-dual': 'detect-dual', 'detect-dual': 'segment'}


@pytest.fixture(scope='module')
def refusals(patched_tree, task_datasets, tmp_path_factory) -> dict:
    """{task: the CompletedProcess of its entry point given the model of WRONG_MODELS[task]}: the five processes
    run side by side (each one process, which only imports and parses: most of its time is Python's imports)."""
    procs, outputs = {}, {}
    with contextlib.ExitStack() as files:
        for task, wrong in WRONG_MODELS.items():
            args = train_args(task_datasets[labels_of(task)], tmp_path_factory.mktemp(f'refused-{task}') / 'runs', 1,
                              4, 64, cfg=task_cfg(wrong))
            outputs[task] = [files.enter_context(tempfile.TemporaryFile()) for _ in ('stdout', 'stderr')]
            procs[task] = zygote.popen([sys.executable, TASKS[task].script, *args], patched_tree, job_env(), job_env(),
                                       *outputs[task])
        try:
            for proc in procs.values():
                proc.wait(300)
            return {task: subprocess.CompletedProcess(proc.args, proc.returncode, *map(zygote.text_of, outputs[task]))
                    for task, proc in procs.items()}
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize('task', list(TASKS))
def test_a_model_of_another_task_is_refused_before_the_data_is_read(refusals, task):
    other, result = TASKS[WRONG_MODELS[task]], refusals[task]
    errors = [line for line in result.stderr.splitlines() if ': error' in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f'{TASKS[task].script}: error: ') and f'train it with {other.script}' in errors[0]
    assert 'Scanning' not in result.stdout + result.stderr and 'Traceback' not in result.stderr


# -- segmentation ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_segmentation_draws_every_training_image_once_per_epoch(probed):
    ranks = [rank['sampler'] for rank in probed('segment', 2)]  # the 2-process job of the task
    files = ranks[0]['files']
    for epoch in range(2):
        drawn = [p for rank in ranks for p in rank['epochs'][epoch]]
        assert set(drawn) == set(files)
        assert len(drawn) - len(files) == repeats_per_epoch(len(files), 16, 2)  # the job's global batch: 8 x 2


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


# -- which entry point trains which model (fast) -----------------------------------------------------------------------

def test_every_upstream_model_config_has_exactly_one_way_to_train_it(pinned_upstream):
    from yolov9_ddp.tasks import UPSTREAM_ONLY
    from yolov9_ddp.cli import head_of
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


def test_the_final_validation_takes_the_ema_of_best_pt_as_upstreams_attempt_load_does():
    """train.py leaves best.pt unstripped, its model the raw one beside the EMA: the final validation takes the EMA,
    as upstream's attempt_load does; a stripped checkpoint's model is its EMA already."""
    import torch
    from yolov9_ddp.checkpoints import final_model, stripped
    raw, ema = torch.nn.Conv2d(1, 1, 1), torch.nn.Conv2d(1, 1, 1)
    assert final_model({'model': raw, 'ema': ema}) is ema
    assert final_model(stripped({'model': raw, 'ema': ema, 'optimizer': {}, 'updates': 3})) is ema
    assert final_model({'model': raw, 'ema': None}) is raw
