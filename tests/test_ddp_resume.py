"""Rank-0 atomic checkpoints, --resume under torchrun, extending a run, and which options a resume takes from the run
(the automatic resume after torchrun restarts a killed job is a job of tests/test_experiment.py, a resume on another
number of processes with the run's own options one of tests/test_same_run.py)."""
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
import yaml

from testsupport.faults import (children_of, faulty_torchrun, one_error_line_problems, results_epochs,
                               weights_snapshot)
from testsupport.jobs import job_env, run, torchrun_cmd, train_args
from testsupport.injected import Fault, to_env
from testsupport.trees import KIT, copy_tree, run_applier
from yolov9_ddp import checkpoints, cli, experiment, runs
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset
from yolov9_ddp.tasks import TASKS

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures('upstream_importable')]
EPOCHS = 4


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
    return ensure_demo_dataset(tmp_path_factory.mktemp('data') / 'demo', DemoSpec(train=64, val=16, imgsz=64))


def wait_for(condition, process, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        assert process.poll() is None, f'the job ended early:\n{process.stdout.read()[-3000:]}'
        time.sleep(0.1)
    raise AssertionError('timed out waiting for the job')


def start(cmd, cwd, **env):
    return subprocess.Popen(cmd, cwd=cwd, env=job_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def kill_job(job):
    """SIGKILL the agent and its workers (torchrun starts each worker in a session of its own)."""
    for pid in children_of(job.pid) + [job.pid]:
        os.kill(pid, signal.SIGKILL)
    job.wait()


def assert_completed_every_epoch(project: Path, output: str):
    folders = [p for p in project.iterdir() if p.is_dir()]
    assert [p.name for p in folders] == ['exp'], 'one run folder, however often the job was restarted'
    epochs = results_epochs(folders[0])
    assert sorted(set(epochs)) == list(range(EPOCHS)), epochs
    assert len(epochs) - len(set(epochs)) <= 1  # at most the epoch in progress at the kill is repeated
    assert 'mAP50-95' in output
    final = checkpoints.load_checkpoint(folders[0] / 'weights' / 'last.pt')
    assert final['epoch'] == -1 and final['optimizer'] is None  # stripped at the end, as upstream does
    assert not list((folders[0] / 'weights').glob('.*.tmp')), 'temporary checkpoint files left behind'


# -- atomic saving -----------------------------------------------------------------------------------------------------

def test_save_atomic_replaces_the_file_whole(tmp_path):
    target = tmp_path / 'last.pt'
    checkpoints.save_file({'epoch': 1, 'model': torch.zeros(3)}, target)
    checkpoints.save_file({'epoch': 2, 'model': torch.ones(3)}, target)
    assert torch.load(target)['epoch'] == 2
    assert [p.name for p in tmp_path.iterdir()] == ['last.pt']


def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / 'last.pt'
    checkpoints.save_file({'epoch': 1, 'model': torch.zeros(3)}, target)

    def dies_half_way(obj, f, **kw):
        f.write(b'PK\x03\x04 partial')
        raise KeyboardInterrupt  # what SIGINT raises in the middle of a write

    monkeypatch.setattr(torch, 'save', dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save_file({'epoch': 2, 'model': torch.ones(3)}, target)
    monkeypatch.undo()
    assert checkpoints.load_checkpoint(target)['epoch'] == 1
    assert [p.name for p in tmp_path.iterdir()] == ['last.pt']


def test_a_copy_of_a_checkpoint_is_its_bytes_moved_into_place_whole(tmp_path, monkeypatch):
    """best.pt and epochN.pt: the epoch's last.pt copied, not pickled again; a crash mid-copy keeps the old file."""
    last, best = tmp_path / 'last.pt', tmp_path / 'best.pt'
    checkpoints.save_file({'epoch': 2, 'model': torch.ones(3)}, last)
    checkpoints.save_file({'epoch': 1, 'model': torch.zeros(3)}, best)
    checkpoints.copy_file(last, best)
    assert best.read_bytes() == last.read_bytes()

    def dies_half_way(source, target, length):
        target.write(source.read(10))
        raise KeyboardInterrupt
    monkeypatch.setattr(shutil, 'copyfileobj', dies_half_way)
    checkpoints.save_file({'epoch': 3, 'model': torch.ones(3)}, last)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.copy_file(last, best)
    assert checkpoints.load_checkpoint(best)['epoch'] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ['best.pt', 'last.pt']


def test_a_truncated_checkpoint_is_reported_not_loaded(tmp_path):
    target = tmp_path / 'last.pt'
    checkpoints.save_file({'epoch': 1, 'model': torch.zeros(1000)}, target)
    target.write_bytes(target.read_bytes()[:200])
    with pytest.raises(checkpoints.CheckpointError, match='truncated or corrupt'):
        checkpoints.load_checkpoint(target)



def test_a_final_checkpoint_beside_its_previous_is_resumed_from_the_previous_with_why(tmp_path):
    """A run stopped between its last epoch's write (stripped) and its recorded end resumes from the checkpoint
    before, saying so in words that fit; a finished run's final checkpoint, alone, is refused with the way on."""
    last, lines = tmp_path / 'last.pt', []
    resumable = {**{key: 0 for key in checkpoints.RESUME_KEYS}, 'epoch': 1, 'model': torch.zeros(1)}
    checkpoints.save_file({'epoch': -1, 'model': torch.zeros(1), 'optimizer': None}, last)
    with pytest.raises(checkpoints.FinalCheckpoint, match='give --epochs beyond its total'):
        checkpoints.load_for_resume(last, lines.append)
    checkpoints.save_file(resumable, checkpoints.previous_path(last))
    ckpt, source = checkpoints.load_for_resume(last, lines.append)
    assert source == checkpoints.previous_path(last) and ckpt['epoch'] == 1
    assert lines == [f"WARNING: {last} is the run's final checkpoint, but the run stopped before its end was "
                     f"recorded; resuming from {source} instead (one checkpoint earlier)"]

def test_a_start_that_trains_epochs_again_drops_their_results_rows(tmp_path):
    """Rows of the epoch the start continues at and later go, a row cut short by a kill with them; those before stay
    byte for byte."""
    header, kept = '               epoch,      train/box_loss\n', [f'{e:>20},{0.5:>20}\n' for e in range(2)]
    results = tmp_path / 'results.csv'
    results.write_text(header + ''.join(kept) + f'{2:>20},{0.4:>20}\n' + '     ')
    experiment.continue_results_csv(tmp_path, 2)
    assert results.read_text() == header + ''.join(kept)
    experiment.continue_results_csv(tmp_path, 2)
    assert results.read_text() == header + ''.join(kept)
    experiment.continue_results_csv(tmp_path, 0)
    assert results.read_text() == header


# -- resume ------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_resume_continues_in_the_same_folder_at_the_next_epoch(patched_tree, dataset, tmp_path):
    """Also: a --resume typed while the run still trains is refused in one line (runs.hold_run), with the run's
    checkpoints untouched; here rank 0 lingers 12 s inside epoch 1 so that the run is still training."""
    project, records = tmp_path / 'runs', tmp_path / 'records'
    args = train_args(dataset, project, EPOCHS, 4, 64)
    job = start(faulty_torchrun(2, args), patched_tree, FAULT=to_env(Fault('mark', epoch=1, step=1, sleep=12)),
                FAULT_DIR=records)
    last = project / 'exp' / 'weights' / 'last.pt'
    wait_for(lambda: (records / 'mark-mark').exists(), job)
    wait_for(lambda: runs.read_record(project / 'exp').get('saved_epoch') == 0, job)  # written off the training thread
    weights = weights_snapshot(project / 'exp')
    second = run([sys.executable, 'ddp_train_dual.py', '--resume', last], patched_tree)
    assert second.returncode == 1 and job.poll() is None, second.stderr[-3000:]
    assert not one_error_line_problems(second.stderr, f'{project / "exp"} is being trained by process'), second.stderr
    assert weights_snapshot(project / 'exp') == weights
    kill_job(job)
    saved = checkpoints.load_checkpoint(last, require_resume_state=True)
    for key in ('model', 'ema', 'updates', 'optimizer', 'scaler', 'epoch', 'best_fitness', 'opt'):
        assert key in saved, f'checkpoint lacks {key}'
    assert saved['ema'] is not None and saved['updates'] > 0
    assert saved['epoch'] < EPOCHS - 1, 'killed too late to show a resume'

    result = run(torchrun_cmd(2, 'ddp_train_dual.py', '--resume', last, '--device', 'cpu', '--workers', 0),
                 patched_tree, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert f'resuming epoch {saved["epoch"] + 1} at step 0 of ' in output
    assert_completed_every_epoch(project, output)


@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
def test_restart_of_a_finished_job_does_not_train_again(patched_tree, dataset, tmp_path, monkeypatch):
    project = tmp_path / 'runs'
    args = list(map(str, train_args(dataset, project, 1, 4, 64)))
    done = run([sys.executable, 'ddp_train_dual.py', *args, '--auto-resume'], patched_tree)
    assert done.returncode == 0, done.stderr[-2000:]
    again = run([sys.executable, 'ddp_train_dual.py', *args, '--auto-resume'], patched_tree)
    assert again.returncode == 0
    assert 'already finished' in again.stdout + again.stderr
    assert [p.name for p in project.iterdir()] == ['exp']


# -- the run's own options, on any number of processes (the world size belongs to a start) -------------------------

def test_a_global_batch_names_the_process_counts_it_splits_over():
    assert cli.divisors(12) == [1, 2, 3, 4, 6, 12] and cli.divisors(7) == [1, 7] and cli.divisors(1) == [1]
    assert cli.uneven_split(12, 5).endswith('global batch 12 cannot be split over 5 processes; '
                                            'it can over 1, 2, 3, 4, 6 or 12')
    assert cli.uneven_split(7, 2).endswith('it can over 1 or 7')


def test_a_resume_keeps_the_runs_options_but_the_start_options_given_for_it(tmp_path):
    hyp = tmp_path / 'hyp.yaml'
    hyp.write_text('lr0: 0.01\n')
    argv = ['--resume', 'last.pt', '--workers', '2', '--batch-size', '16', '--epochs', '3', '--hyp', str(hyp),
            '--checkpoint-minutes', '5']
    dual = TASKS['detect-dual']
    options, given = vars(cli.parse_args(argv, tmp_path, dual)), cli.given_flags(argv, tmp_path, dual)
    recorded = {'batch_size': 12, 'epochs': 3, 'device': 'cpu', 'workers': 0, 'ddp_timeout': 60.0,
                'hyp': {'lr0': 0.01, 'anchor_t': 5.0}, 'auto_resume': True, 'checkpoint_steps': 200,
                'checkpoint_minutes': 10.0}
    resumed = runs.resumed_options(options, recorded, given)
    assert (resumed['batch_size'], resumed['device'], resumed['ddp_timeout']) == (12, 'cpu', 60.0)  # the run's
    assert (resumed['workers'], resumed['auto_resume']) == (2, False)  # given for this start / how it was launched
    assert (resumed['checkpoint_minutes'], resumed['checkpoint_steps']) == (5.0, 200)  # given / the run's
    # --epochs and --hyp say what the run has; --resume, --workers and --checkpoint-minutes are this start's
    assert runs.overruled_flags(options, recorded, given) == ['--batch-size 16 (the run has 12)']


# -- a run of the previous release -------------------------------------------------------------------------------------

PREVIOUS_RELEASE = 'c355b24'  # kit 0.6.0, whose checkpoints and opt.yaml recorded 16 levers


@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
def test_a_run_of_kit_0_6_0_resumes_at_its_step_once_the_clone_is_upgraded(pinned_upstream, dataset, tmp_path):
    """A clone patched by kit 0.6.0 whose run was killed mid-epoch, then upgraded by this kit (apply_patches.py over
    the old one): --resume continues the run at the step of 0.6.0's periodic checkpoint, its recorded levers of 0.6.0
    dropped without a word, and completes it."""
    old_kit, tree, project = tmp_path / 'kit-0.6.0', copy_tree(pinned_upstream, tmp_path / 'yolov9'), tmp_path / 'runs'
    old_kit.mkdir()
    archive = subprocess.run(['git', '-C', str(KIT), 'archive', PREVIOUS_RELEASE], capture_output=True, check=True)
    tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(old_kit, filter='data')
    assert run_applier(tree, kit=old_kit).returncode == 0
    job = start([sys.executable, 'ddp_train_dual.py', *map(str, train_args(dataset, project, 2, 4, 64)),
                 '--checkpoint-steps', '2'], tree)
    wait_for(lambda: (runs.read_record(project / 'exp').get('saved_position') or [0])[0] == 1, job)
    kill_job(job)
    epoch, step = runs.read_record(project / 'exp')['saved_position']
    assert 'host_targets=' in checkpoints.load_checkpoint(project / 'exp' / 'weights' / 'last.pt')['opt']['levers']

    upgraded = run_applier(tree)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    result = run([sys.executable, 'ddp_train_dual.py', '--resume', project / 'exp' / 'weights' / 'last.pt'], tree,
                 timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert f'resuming epoch {epoch} at step {step} of 16 from ' in output
    assert 'lever' not in output.replace('levers=', ''), 'a lever of 0.6.0 spoken of'
    assert results_epochs(project / 'exp')[-1] == 1 and runs.read_record(project / 'exp')['finished']


# -- extending a run ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
def test_a_finished_run_extended_with_epochs_goes_on_from_its_last_epoch(patched_tree, dataset, tmp_path):
    """--resume last.pt --epochs 3 on a finished run of 2: its stripped last.pt goes on from its EMA weights with a
    new optimizer state, to epoch 2, the schedule of 3 epochs from there, in one line; opt.yaml records it. Every
    other flag given stays the run's, in one line; a total the run has reached already is refused in one line."""
    project = tmp_path / 'runs'
    last = project / 'exp' / 'weights' / 'last.pt'
    assert run([sys.executable, 'ddp_train_dual.py', *train_args(dataset, project, 2, 8, 64)], patched_tree,
               timeout=300).returncode == 0
    result = run([sys.executable, 'ddp_train_dual.py', '--resume', last, '--epochs', 3, '--batch-size', 4],
                 patched_tree, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert ('extending the run from 2 to 3 epochs at epoch 2, from its final EMA weights with a new optimizer state: '
            'the learning rate follows the schedule of 3 epochs from here') in output
    assert 'these flags are ignored: --batch-size 4 (the run has 8)' in output
    assert results_epochs(project / 'exp') == [0, 1, 2] and runs.read_record(project / 'exp')['finished']
    options = yaml.safe_load((project / 'exp' / 'opt.yaml').read_text())
    assert options['epochs'] == 3 and options['extended'] == [{'at_epoch': 2, 'from': 2, 'to': 3}]
    for epochs, fragment in ((3, 'give --epochs beyond its total to train it further'),
                             (2, '--epochs 2: the run has trained 3 epochs already')):
        refused = run([sys.executable, 'ddp_train_dual.py', '--resume', last, '--epochs', epochs], patched_tree)
        assert refused.returncode != 0 and not one_error_line_problems(refused.stderr, fragment), refused.stderr
