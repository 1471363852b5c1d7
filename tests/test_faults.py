"""Fault tolerance and hostile input: real torchrun jobs (gloo on CPU, the tiny model, generated data) killed,
signalled, stalled, restarted, and fed damaged checkpoints and datasets.

Faults come from outside the production code: testsupport/probes/faulty_train.py runs ddp_train_dual.main() with
some of its functions wrapped (a SIGKILL mid-step, mid-validation, half-way through a checkpoint file; a rank that
hangs before a collective) and records what each rank did. The scenarios live in testsupport/faults.py, shared with
bench/reliability.py, which runs them repeatedly for the table of docs/reliability.md.

Covered elsewhere, not repeated here: labels with a class >= nc (tests/test_ddp_errors.py,
test_labels_with_a_class_beyond_nc and test_every_rank_exits_by_itself_on_labels_beyond_nc); the applier killed
half-way or racing another applier (tests/test_applier.py).
"""
import json
import os
import random
import signal
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from testsupport.faults import (FAULT_EPOCHS, FAULTY, KILL_FAULTS, RAISE_FAULTS, STOP_DEADLINE_S, WORKER_KILL_FAULTS,
                                WORKERS, completed_run_problems, epochs_redone, failure_scenario, fallback_scenario,
                                fault_args, faulty_torchrun, interrupted_run, kill_scenario, lost_checkpoints_scenario,
                                node_cmd, one_error_line_problems, random_kill_scenario, refused_checkpoint_scenario,
                                run_folders, scenario_args, signal_scenario, slow_filesystem_resume_scenario,
                                stall_scenario, start_job, wait_for_path)
from testsupport.jobs import PROBE, copy_dataset, free_port, launch_cmd, train_args
from testsupport.injected import Fault
from yolov9_ddp import checkpoints, state
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset

# A test whose clock checks are tight (a stop, a failure or a timeout within seconds) is marked timed; the others
# allow minutes for what takes seconds, and run beside other jobs (testsupport/cores.py).
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures('upstream_importable')]
SPEC = DemoSpec(train=48, val=16, imgsz=64)  # 12 steps per epoch on each of 2 ranks at batch 4
# A fault in epoch 1 of 2: the epoch before it is checkpointed, the faulted one is trained again and ends the run.
# (FAULT_EPOCHS, 3, where the scenario needs a third epoch: two kills in a row, an interrupted run's
# last.previous.pt.)
EPOCHS = 2


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
    return ensure_demo_dataset(tmp_path_factory.mktemp('faults') / 'demo', SPEC)


def test_epochs_redone_counts_from_the_epoch_in_progress_to_the_next_start():
    """The measure the kill and signal tests assert on (testsupport.faults.epochs_redone), on made-up records: a kill
    in epoch 1 restarted at epoch 1 costs 1, a kill after epoch 1 was saved and restarted at 2 costs 0, a stop
    (rank 0 exiting by a signal) never followed by a start costs None."""
    def start(t, epoch):
        return {'kind': 'start', 'rank': 0, 'time': t, 'start_epoch': epoch}
    kill = {'kind': 'fired', 'rank': 1, 'fault': {'action': 'kill'}}
    events = [start(0, 0), {**kill, 'time': 1, 'epoch': 1}, start(2, 1), {**kill, 'time': 3, 'epoch': 1},
              start(4, 2), {'kind': 'fired', 'rank': 0, 'time': 5, 'epoch': 2, 'fault': {'action': 'mark'}},
              {'kind': 'exit', 'rank': 0, 'time': 6, 'epoch': 2, 'status': 143}]
    assert epochs_redone(events) == [1, 0, None]


# -- 1. killed workers -------------------------------------------------------------------------------------------------

# The kills other than mid-step share one job (mid-step has its own, the smoke lane's): each strikes in the next attempt
# (torchrun's restart) and the next epoch, so each costs what it costs alone: the epoch it struck in. 'twice': the first
# kill, of rank 1 mid-step, and the second, of rank 0 in the restarted job.
KILL_CHAIN = {
    'twice': Fault('kill', rank=1, epoch=1, step=2),
    'mid-validation': Fault('kill', rank=0, where='val', epoch=2),
    'mid-checkpoint-write': Fault('kill', rank=0, where='save', epoch=3),
    'between-checkpoint-renames': Fault('kill', rank=0, where='rename', epoch=4),
    'while-stripping-at-the-end': Fault('kill', rank=0, where='strip'),
}
CHAIN_EPOCHS = 5


@pytest.fixture(scope='module')
def kill_chain(patched_tree, dataset, tmp_path_factory):
    """The outcome of one job killed as KILL_CHAIN says, one kill per attempt, in that order."""
    fault = [replace(item, attempt=attempt) for attempt, item in enumerate(KILL_CHAIN.values())]
    return kill_scenario(patched_tree, dataset, tmp_path_factory.mktemp('kill-chain'), fault, epochs=CHAIN_EPOCHS,
                         max_restarts=len(KILL_CHAIN), timeout=480)


@pytest.mark.slow
@pytest.mark.parametrize('where', [pytest.param('mid-step', marks=[pytest.mark.smoke, pytest.mark.timed]),
                                   'mid-validation',
                                   'mid-checkpoint-write', 'between-checkpoint-renames', 'twice'])
def test_a_killed_worker_costs_at_most_the_epoch_in_progress(patched_tree, dataset, tmp_path, request, where):
    if where == 'mid-step':
        fault, faults, epochs = KILL_FAULTS[where], [where], EPOCHS
        outcome = kill_scenario(patched_tree, dataset, tmp_path, fault, epochs=epochs)
    else:
        fault, faults, epochs = KILL_CHAIN[where], list(KILL_CHAIN), CHAIN_EPOCHS
        outcome = request.getfixturevalue('kill_chain')
    assert not outcome.problems, outcome.describe()
    kills = outcome.detail['kills']
    assert len(kills) == len(faults) and all(k['epoch'] < epochs for k in kills), outcome.describe()
    at = faults.index(where)
    fired = kills[at]
    assert fired['attempt'] == at and (fired['rank'], fired['fault']['where']) == (fault.rank, fault.where), \
        outcome.describe()
    mine = [at, at + 1] if where == 'twice' else [at]  # twice: this kill and the next, of the other rank
    assert len(outcome.redone) == len(kills) and all(outcome.redone[n] == 1 for n in mine), outcome.describe()
    assert len(outcome.watcher.loaded) >= 2, f'checkpoints seen while training: {outcome.watcher.loaded}'
    if where == 'twice':
        assert kills[at + 1]['attempt'] == 1 and kills[at + 1]['rank'] != fired['rank'], outcome.describe()
    if where == 'mid-checkpoint-write':  # the temporary file was really half written when rank 0 died
        assert Path(fired['file']).name.startswith('.last.pt.') and fired['file'].endswith('.tmp')
        assert 0 < fired['written'] < fired['size']
    if where == 'between-checkpoint-renames':  # last.pt was missing: the restart took last.previous.pt
        assert 'last.previous.pt instead' in outcome.output, outcome.describe()


@pytest.mark.slow
def test_a_kill_while_the_final_checkpoint_is_stripped_leaves_a_loadable_last_pt(kill_chain):
    """At the end rank 0 strips last.pt and best.pt; a kill then must not leave the run without a loadable last.pt
    (the last kill of the chain: the completed run's checks of kill_scenario hold after it)."""
    assert kill_chain.detail['kills'][-1]['fault']['where'] == 'strip', kill_chain.describe()
    assert not kill_chain.problems, kill_chain.describe()


# -- 1b. killed loader workers, a failure on one rank (neither may hang the job) ---------------------------------------

@pytest.fixture(scope='module')
def worker_kill_chain(patched_tree, dataset, tmp_path_factory):
    """The outcome of one job whose loader workers are killed as WORKER_KILL_FAULTS say, one kill per attempt, in that
    order, each in the next epoch (the first in epoch 1), the final validation's last. An epoch follows the last of
    them: the last epoch's write is the final strip (parts/epoch_end.py), after which training has ended."""
    chain = [replace(fault, epoch=attempt + 1 if fault.epoch == 1 else fault.epoch, attempt=attempt)
             for attempt, fault in enumerate(WORKER_KILL_FAULTS.values())]
    return kill_scenario(patched_tree, dataset, tmp_path_factory.mktemp('worker-kill-chain'), chain,
                         epochs=len(chain) + 1, max_restarts=len(chain), timeout=480, extra=WORKERS)


@pytest.mark.slow
@pytest.mark.parametrize('where', list(WORKER_KILL_FAULTS))
def test_a_killed_loader_worker_restarts_the_job_which_completes(worker_kill_chain, where):
    """The kernel's out-of-memory killer often picks a loader worker. The trainer learns of it wherever it is
    (training, validation, writing a checkpoint, the final validation), fails, and torchrun restarts the job. The
    five kills share one job (worker_kill_chain), each in an attempt of its own."""
    outcome, at = worker_kill_chain, list(WORKER_KILL_FAULTS).index(where)
    assert not outcome.problems and len(outcome.redone) == len(WORKER_KILL_FAULTS), outcome.describe()
    fired = outcome.detail['kills'][at]
    fault = WORKER_KILL_FAULTS[where]
    assert fired['attempt'] == at and (fired['rank'], fired['fault']['loader'], fired['fault']['where']) == (
        fault.rank, fault.loader, fault.where), outcome.describe()
    if where != 'validation worker in the final validation':  # that one strikes after the last epoch is saved
        assert outcome.redone[at] in (0, 1), outcome.describe()  # at most its epoch


@pytest.mark.timed
@pytest.mark.slow
@pytest.mark.parametrize('what', list(RAISE_FAULTS))
def test_a_failure_on_one_rank_ends_the_job_promptly_with_its_cause(patched_tree, dataset, tmp_path, what):
    """Without restarts: one error line naming the cause, also in torchrun's summary, the job gone within the
    deadline (not --ddp-timeout, 3 h) and no process of it left, loader workers included."""
    fault, fragments = RAISE_FAULTS[what]
    outcome = failure_scenario(patched_tree, dataset, tmp_path, fault, fragments)
    assert not outcome.problems, outcome.describe()


@pytest.mark.slow
def test_an_exception_on_one_rank_is_survived_by_a_restart(patched_tree, dataset, tmp_path):
    fault, _ = RAISE_FAULTS['in the loss']
    outcome = kill_scenario(patched_tree, dataset, tmp_path, fault, epochs=EPOCHS, max_restarts=1, extra=WORKERS)
    assert not outcome.problems, outcome.describe()
    assert outcome.redone == [1], outcome.describe()


@pytest.mark.timed
@pytest.mark.slow
@pytest.mark.parametrize('seed', [1, 2])
def test_a_random_process_of_the_job_killed_at_a_random_moment(patched_tree, dataset, tmp_path, seed):
    outcome = random_kill_scenario(patched_tree, dataset, tmp_path, seed)
    assert not outcome.problems, outcome.describe()


# -- 2. SIGTERM and Ctrl-C ---------------------------------------------------------------------------------------------

@pytest.mark.timed
@pytest.mark.slow
@pytest.mark.smoke
def test_sigterm_to_torchrun_with_save_on_signal_stops_cleanly_and_resumes(patched_tree, dataset, tmp_path):
    outcome = signal_scenario(patched_tree, dataset, tmp_path, signal.SIGTERM, save_on_signal=True, epochs=EPOCHS)
    assert not outcome.problems, outcome.describe()
    stopped, resumed = outcome.jobs
    assert stopped.returncode != 0 and outcome.detail['stop_seconds'] < STOP_DEADLINE_S
    assert outcome.detail['saved_epoch'] == 0  # interrupted in epoch 1: the last complete epoch is 0
    last = outcome.project / 'exp' / 'weights' / 'last.pt'
    assert 'resuming epoch 1 at step ' in resumed.output() and f'from {last}' in resumed.output(), outcome.describe()
    assert outcome.redone == [1], outcome.describe()


@pytest.mark.timed
@pytest.mark.slow
def test_sigterm_to_torchrun_without_save_on_signal_keeps_the_last_epoch(patched_tree, dataset, tmp_path):
    outcome = signal_scenario(patched_tree, dataset, tmp_path, signal.SIGTERM, save_on_signal=False, epochs=EPOCHS)
    assert not outcome.problems, outcome.describe()
    assert outcome.redone == [1], outcome.describe()


@pytest.mark.timed
@pytest.mark.slow
def test_sigint_to_a_single_process_run_exits_130(patched_tree, dataset, tmp_path):
    outcome = signal_scenario(patched_tree, dataset, tmp_path, signal.SIGINT, save_on_signal=False, nproc=1,
                              epochs=EPOCHS, resume=False)
    assert not outcome.problems, outcome.describe()
    assert outcome.jobs[0].returncode == 130, outcome.describe()


@pytest.mark.timed
@pytest.mark.slow
@pytest.mark.one_core  # one process
def test_the_next_epoch_trains_while_an_epochs_checkpoint_is_written_and_a_stop_waits_for_the_write(
        patched_tree, dataset, tmp_path):
    """The write of epoch 0's last.pt takes 8 s (a slow disk, in the writer process): epoch 1's steps run
    meanwhile, and a SIGTERM then stops the run only once that write is in place, the stop's checkpoint after it."""
    write_s, project = 8, tmp_path / 'runs'
    faults = [Fault('slow', where='save', epoch=0, sleep=write_s), Fault('mark', where='loss', epoch=1, step=3)]
    job = start_job(launch_cmd(1, FAULTY, *scenario_args(dataset, project, EPOCHS)), patched_tree, tmp_path, 'job',
                    faults)
    wait_for_path(job.records / 'mark-mark', job)
    os.kill(job.proc.pid, signal.SIGTERM)
    job.wait(STOP_DEADLINE_S)
    fired = {event['fault']['where']: event['time'] for event in job.events('fired')}
    written = fired['save'] + write_s  # the earliest the write of epoch 0 can end
    assert fired['loss'] < written, 'epoch 1 waited for the write of epoch 0\'s checkpoint'
    [ended] = job.events('exit')
    assert ended['status'] == 128 + signal.SIGTERM and ended['time'] >= written, job.output()[-3000:]
    weights = project / 'exp' / 'weights'
    stopped = checkpoints.load_checkpoint(weights / 'last.pt', require_resume_state=True)
    assert stopped[state.KEY]['epoch'] == 1 and stopped[state.KEY]['step'] >= 3
    previous = checkpoints.load_checkpoint(weights / 'last.previous.pt')[state.KEY]  # epoch 0's, whole
    assert (previous['epoch'], previous['step']) == (1, 0)


# -- 3. a stuck rank ---------------------------------------------------------------------------------------------------

@pytest.mark.timed
@pytest.mark.slow
def test_a_stalled_rank_fails_the_job_within_the_ddp_timeout(patched_tree, dataset, tmp_path):
    outcome = stall_scenario(patched_tree, dataset, tmp_path, max_restarts=0, ddp_timeout=10)
    assert not outcome.problems, outcome.describe()
    job = outcome.jobs[0]
    assert job.returncode != 0 and job.wall < 90, outcome.describe()
    assert 10 <= outcome.detail['rank0_gave_up_after'] < 25, outcome.describe()


# -- 4. bad checkpoints ------------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def interrupted(patched_tree, dataset, tmp_path_factory):
    """A run killed at the start of its last epoch: last.pt of epoch 1, last.previous.pt of epoch 0 (copied by each
    test before it damages anything)."""
    return interrupted_run(patched_tree, dataset, tmp_path_factory.mktemp('interrupted'))


@pytest.mark.timed
@pytest.mark.slow
def test_a_truncated_last_pt_falls_back_to_the_previous_checkpoint(patched_tree, dataset, interrupted, tmp_path):
    outcome = fallback_scenario(patched_tree, dataset, tmp_path, source=interrupted)
    assert not outcome.problems, outcome.describe()
    assert outcome.redone == [1], outcome.describe()  # one checkpoint interval lost with the damaged file


@pytest.mark.timed
@pytest.mark.slow
def test_a_resume_reads_the_run_options_safely_on_a_slow_shared_filesystem(patched_tree, dataset, interrupted,
                                                                          tmp_path):
    """Rank 0 rewrites the run's opt.yaml when it sets up a resumed run. With a slow filesystem (the rewrite takes
    5 s) and a rank 1 that is 1.5 s late, every rank must still start from the run's options, not read the file
    while rank 0 is writing it (docs/clone.md: nodes need not even share the run folder)."""
    outcome = slow_filesystem_resume_scenario(patched_tree, dataset, tmp_path, source=interrupted)
    assert not outcome.problems, outcome.describe()


@pytest.mark.timed
@pytest.mark.slow
@pytest.mark.parametrize('how', ['truncated', 'garbage'])
def test_an_unusable_last_pt_without_a_previous_is_refused(patched_tree, dataset, interrupted, tmp_path, how):
    outcome = refused_checkpoint_scenario(patched_tree, dataset, tmp_path, how, source=interrupted)
    assert not outcome.problems, outcome.describe()


@pytest.mark.timed
@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused(patched_tree, dataset, interrupted, tmp_path):
    outcome = refused_checkpoint_scenario(patched_tree, dataset, tmp_path, 'another-model', source=interrupted,
                                          keep_previous=True)
    assert not outcome.problems, outcome.describe()


@pytest.mark.timed
@pytest.mark.slow
@pytest.mark.parametrize('via', ['auto-resume', 'torchrun-restart'])
def test_lost_checkpoints_are_an_error_never_a_silent_restart(patched_tree, dataset, interrupted, tmp_path, via):
    epochs = EPOCHS if via == 'torchrun-restart' else FAULT_EPOCHS  # auto-resume: the interrupted run's
    outcome = lost_checkpoints_scenario(patched_tree, dataset, tmp_path, via, source=interrupted, epochs=epochs)
    assert not outcome.problems, outcome.describe()


# -- 5. bad data -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_corrupt_images_and_empty_labels_are_skipped_on_every_rank(patched_tree, dataset, tmp_path):
    data = copy_dataset(dataset, tmp_path / 'hostile')
    noise = random.Random(5)
    corrupt = []
    for split, count in (('train', 3), ('val', 1)):
        for i in range(count):
            image = tmp_path / 'hostile' / 'images' / split / f'corrupt_{i}.jpg'
            image.write_bytes(noise.randbytes(3000))  # random bytes named .jpg
            (tmp_path / 'hostile' / 'labels' / split / f'corrupt_{i}.txt').write_text('0 0.5 0.5 0.2 0.2\n')
            corrupt.append(image)
    emptied = sorted((tmp_path / 'hostile' / 'labels' / 'train').glob('train_*.txt'))[:4]
    for label in emptied:
        label.write_text('')
    project = tmp_path / 'runs'
    job = start_job(faulty_torchrun(2, fault_args(data, project, 2, '--workers', 1)), patched_tree, tmp_path, 'job')
    job.wait(300)
    output = job.output()
    assert job.returncode == 0, output[-5000:]
    assert sorted((e['rank'], e['status']) for e in job.events('exit')) == [(0, 0), (1, 0)], output[-5000:]
    for image in corrupt:
        assert f'{image}: ignoring corrupt image/label' in output, output[-5000:]
    assert f'{SPEC.train} images, {len(emptied)} backgrounds, 3 corrupt' in output, output[-5000:]
    assert f'{SPEC.val} images, 0 backgrounds, 1 corrupt' in output, output[-5000:]
    assert f'epoch 0: {SPEC.train} images' in output  # the corrupt ones are not trained on
    assert not completed_run_problems(project, 2), completed_run_problems(project, 2)


@pytest.mark.timed
@pytest.mark.slow
def test_a_missing_label_folder_stops_every_rank_promptly(patched_tree, dataset, tmp_path):
    data = copy_dataset(dataset, tmp_path / 'unlabelled', labels=False)
    job = start_job(faulty_torchrun(2, fault_args(data, tmp_path / 'runs', 2, '--ddp-timeout', 60)), patched_tree,
                    tmp_path, 'job')
    job.wait(120)
    output = job.output()
    assert job.returncode != 0 and job.wall < 60, output[-5000:]
    # each rank returned from main() by itself (torchrun did not have to stop a rank left waiting)
    assert sorted((e['rank'], e['status']) for e in job.events('exit')) == [(0, 1), (1, 1)], output[-5000:]
    assert not one_error_line_problems(output, 'No labels found', str(data.parent / 'labels')), output[-5000:]
    assert 'ddp_train_dual.py", line' not in output, output[-5000:]


# -- 6. several nodes on one machine -----------------------------------------------------------------------------------

def two_nodes(tree, workdir: Path, name: str, *args, **env):
    """Two torchrun agents (--nnodes 2, one process each) started side by side; both must end within 240 s."""
    endpoint, run_id = f'127.0.0.1:{free_port()}', f'faults-{uuid.uuid4().hex[:12]}'
    jobs = [start_job(node_cmd(2, endpoint, run_id, *args), tree, workdir, f'{name}-node{n}', **env)
            for n in range(2)]
    for job in jobs:
        job.wait(240)
    output = '\n'.join(job.output() for job in jobs)
    assert [job.returncode for job in jobs] == [0, 0], output[-6000:]
    return output


@pytest.mark.slow
def test_two_nodes_on_one_machine_share_one_label_cache(patched_tree, tmp_path):
    data = ensure_demo_dataset(tmp_path / 'shared', DemoSpec(train=32, val=16, imgsz=64))  # no label cache yet
    caches = [data.parent / 'labels' / 'train.cache', data.parent / 'labels' / 'val.cache']
    project = tmp_path / 'runs'
    args = list(map(str, train_args(data, project, 2, 4, 64)))
    probe_args = list(map(str, train_args(data, tmp_path / 'probe-runs', 1, 4, 64)))  # the probe sets up a run too
    config = {'PROBE_CONFIG': json.dumps({'epochs': 1})}

    two_nodes(patched_tree, tmp_path, 'probe1', PROBE, 'sampler', tmp_path / 'probe1.json', *probe_args, **config)
    first = json.loads((tmp_path / 'probe1.json').read_text())
    assert first['world'] == 2 and len(first['ranks']) == 2
    builds = sorted(tuple(b) for rank in first['ranks'] for b in rank['sampler']['cache_builds'])
    assert builds == [(0, str(caches[0])), (0, str(caches[1]))], builds  # each cache built once, by global rank 0
    written = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in caches]

    output = two_nodes(patched_tree, tmp_path, 'train', 'ddp_train_dual.py', *args)
    assert '2 process(es)' in output, output[-6000:]
    assert [p.name for p in run_folders(project)] == ['exp'], run_folders(project)  # written by global rank 0 only
    assert not completed_run_problems(project, 2), completed_run_problems(project, 2)

    two_nodes(patched_tree, tmp_path, 'probe2', PROBE, 'sampler', tmp_path / 'probe2.json', *probe_args, **config)
    second = json.loads((tmp_path / 'probe2.json').read_text())
    assert [rank['sampler']['cache_builds'] for rank in second['ranks']] == [[], []]  # the second run reuses the cache
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in caches] == written

