"""The kit's Slurm job scripts (slurm/*.sbatch) against a real single-node Slurm that this module starts and always
stops (testsupport/slurm.py: Debian's packages installed when missing, munged, slurmctld and slurmd as children,
every job cancelled and gone before the daemons end).

The jobs are the scripts as shipped, fitted to the test node on the sbatch command line (2 CPUs, 2 fake GPUs;
the 2-node script as 2 tasks on the one node), training the kit's tiny model on the demo data with 2 CPU processes
(gloo). They are stopped the way Slurm stops jobs: a signal to the batch shell (what a pre-emption notice or
`scancel --batch --signal=TERM` sends) and the warning `--signal=B:TERM@N` sends before a time limit; `scancel`
ends a job for good.
"""
import os
import signal
import subprocess
import sys

import pytest

from testsupport.jobs import run, train_args
from testsupport.slurm import (SCRIPTS, STOPPED, completed_after_stops_problems, held_first_start,
                               resumable_checkpoint_at_requeue, running_cluster, slowed_launcher, submit_training)
from testsupport.trees import describe
from yolov9_ddp.shutdown import StopRequest

SCRIPT_NAMES = sorted(path.name for path in SCRIPTS.glob('*.sbatch'))
LAUNCHERS = {'multi-node.sbatch': 'srun', 'single-node.sbatch': 'torchrun'}  # what each script starts training with
pytestmark = pytest.mark.timed  # Slurm's time limits, pre-emption and KillWait run on the clock
EPOCHS = 4
JOB_DEADLINE_S = 360


@pytest.fixture(scope='module')
def cluster():
    with running_cluster() as started:
        yield started


# -- without a cluster -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('script', SCRIPT_NAMES)
def test_a_job_script_started_outside_slurm_says_so_in_one_line(script, patched_tree, offline_env):
    env = {k: v for k, v in offline_env.items() if not k.startswith('SLURM_')}
    result = subprocess.run(['bash', str(SCRIPTS / script), '--epochs', '1'], cwd=patched_tree, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, describe(result)
    assert result.stderr.splitlines() == [f'{script}: error: not inside a Slurm job (SLURM_JOB_ID is unset): submit '
                                          f'this script with sbatch'], describe(result)
    assert result.stdout == '', describe(result)


FAKE_LAUNCHER = '#!/bin/bash\nprintf "%s\\n" "$@" > "$LAUNCHED"\n'  # torchrun or srun: records its arguments


@pytest.mark.parametrize('script', SCRIPT_NAMES)
@pytest.mark.parametrize('flags, default', [([], ['--checkpoint-minutes', '10']),
                                            (['--checkpoint-steps', '500'], []),
                                            (['--checkpoint-minutes=0'], [])])
def test_a_job_checkpoints_every_10_minutes_unless_its_flags_say_how_often(script, flags, default, tmp_path):
    """What the script launches, with torchrun, srun and scontrol replaced by scripts that record it."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, text in (('torchrun', FAKE_LAUNCHER), ('srun', FAKE_LAUNCHER), ('scontrol', '#!/bin/bash\necho n1\n')):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / 'ddp_train_dual.py').touch()
    env = {'PATH': f'{bin_dir}:/usr/bin:/bin', 'LAUNCHED': str(tmp_path / 'launched'), 'SLURM_JOB_ID': '7',
           'SLURM_JOB_NAME': 'yolov9-ddp', 'SLURM_GPUS_ON_NODE': '2', 'SLURM_GPUS_PER_TASK': '2',
           'SLURM_NTASKS': '1', 'SLURM_JOB_NODELIST': 'n1'}
    result = subprocess.run(['bash', str(SCRIPTS / script), '--epochs', '1', *flags], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, describe(result)
    launched = (tmp_path / 'launched').read_text().splitlines()
    assert launched[launched.index('ddp_train_dual.py') + 1:] == ['--auto-resume', '--save-on-signal', *default,
                                                                  '--name', 'yolov9-ddp-7', '--epochs', '1', *flags]


def test_a_repeated_sigterm_is_one_stop_request_and_a_second_sigint_interrupts():
    """Slurm signals every process of a job step and torchrun passes its own SIGTERM on: each training process may
    get SIGTERM twice, which must not cut short the checkpoint the first asked for."""
    request = StopRequest(check_every=1)
    try:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        assert request.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        request.close()


@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
def test_a_requeued_job_whose_command_cannot_continue_its_run_is_warned(patched_tree, demo_data, offline_env,
                                                                         tmp_path):
    env = {**offline_env, 'SLURM_JOB_ID': '41', 'SLURM_RESTART_COUNT': '1'}
    args = train_args(demo_data, tmp_path / 'runs', 1, 4, 64)
    result = run([sys.executable, 'ddp_train_dual.py', *map(str, args)], patched_tree, timeout=300, env=env)
    assert result.returncode == 0, describe(result)
    output = result.stdout + result.stderr
    assert output.count('Slurm job 41 was requeued (SLURM_RESTART_COUNT=1), but without --auto-resume this start '
                        'cannot continue the previous one') == 1, describe(result)


# -- against the cluster ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.usefixtures('upstream_importable')
@pytest.mark.parametrize('script', SCRIPT_NAMES)
def test_a_preempted_job_requeues_itself_and_completes_its_run(script, cluster, patched_tree, demo_data, offline_env,
                                                               tmp_path):
    """Two pre-emption notices (SIGTERM to the batch shell only) to one job, each followed by a requeue, all its
    starts appending to the same log. The first comes while the script's launcher starts (srun before its job step
    exists, which `scancel --signal` cannot reach yet; torchrun before it handles signals): a wrapper first on the
    job's PATH makes the launcher start slowly, so that the notice lands there every time, and it must not be lost.
    The second comes mid-epoch: the training stops after an agreed step with a resumable last.pt, and the next
    start resumes that checkpoint in the same run folder and completes every epoch."""
    started = tmp_path / 'launcher-started'
    job = submit_training(cluster, script, patched_tree, tmp_path, demo_data, EPOCHS, offline_env,
                          first_on_path=slowed_launcher(tmp_path / 'wrapper', LAUNCHERS[script], started))
    job.wait_for(lambda _: started.exists(), JOB_DEADLINE_S, f'start {LAUNCHERS[script]}')
    cluster.command('scancel', '--batch', '--signal=TERM', job.id)
    job.wait_for_epochs(1, JOB_DEADLINE_S)  # the next start's epoch 1 is under way
    cluster.command('scancel', '--batch', '--signal=TERM', job.id)
    saved = resumable_checkpoint_at_requeue(job, 120)  # the stop mid-epoch's requeue
    fields = job.wait_until_ended(JOB_DEADLINE_S)
    problems = completed_after_stops_problems(job, fields, EPOCHS, stops=1, launch_stops=1)
    assert not problems, f'{problems}\n{saved}\n{job.output()[-6000:]}'
    # the stop wrote the state of the interrupted epoch beside the checkpoint of the epoch before it, and the
    # next start resumed from it (not from last.previous.pt) to run the interrupted epoch again
    assert saved['epoch'] == saved['previous_epoch'] == len(saved['rows']) - 1, saved
    assert saved['updates'] >= saved['previous_updates'], saved
    last = job.run_dir / 'weights' / 'last.pt'
    assert f'resuming epoch {saved["epoch"] + 1} at step ' in job.output() and f'from {last}' in job.output(), saved


@pytest.mark.slow
@pytest.mark.usefixtures('upstream_importable')
def test_a_job_that_reaches_its_time_limit_requeues_itself_and_completes_its_run(cluster, patched_tree, demo_data,
                                                                                offline_env, tmp_path):
    """--time=1 --signal=B:TERM@5: Slurm warns the batch shell at its first time-limit check at least 25 s
    (1 min - 5 s - the 30 s between its checks) into each start, so between 25 and 55 s; the job stops with a
    resumable last.pt, requeues itself and completes its run. Its first start holds rank 0 in epoch 1 until the
    warning comes (testsupport/slurm.py held_first_start), so that the warning finds it training on a fast machine
    too; the requeued start trains at full speed and ends before its own warning, or is warned once more and
    starts again."""
    first_on_path, entry = held_first_start(tmp_path / 'wrapper', hold_s=90)
    job = submit_training(cluster, 'single-node.sbatch', patched_tree, tmp_path, demo_data, 2,
                          {**offline_env, **entry}, options=('--time=1', '--signal=B:TERM@5'),
                          first_on_path=first_on_path)
    fields = job.wait_until_ended(JOB_DEADLINE_S)
    output = job.output()
    stops = output.count(STOPPED.format(last=job.run_dir / 'weights' / 'last.pt'))
    assert stops >= 1, f'the time limit never stopped the training: {fields}\n{output[-6000:]}'
    late_stops = output.count('already finished')  # a warning after a start's last step: one more, empty start
    assert late_stops <= 1, output[-6000:]
    problems = completed_after_stops_problems(job, fields, 2, stops, late_stops)
    assert not problems, f'{problems}\n{output[-6000:]}'
    assert 'resuming epoch 1 at step ' in output, output[-6000:]  # the first stop came in epoch 1, held there


@pytest.mark.slow
def test_scancel_ends_the_job_without_requeueing_it(cluster, patched_tree, demo_data, offline_env, tmp_path):
    """scancel sends SIGTERM to every process of the job, the batch shell included: the training still stops
    cleanly, but the job must stay cancelled (Slurm is ending it, not warning it)."""
    job = submit_training(cluster, 'single-node.sbatch', patched_tree, tmp_path, demo_data, EPOCHS, offline_env)
    job.wait_for_epochs(1, JOB_DEADLINE_S)
    cluster.command('scancel', job.id)
    fields = job.wait_until_ended(120)
    assert (fields.get('JobState'), fields.get('Restarts')) == ('CANCELLED', '0'), job.output()[-4000:]
    assert f'job {job.id}: stopped on a signal (exit 1); the job is COMPLETING: not requeued' in \
        job.output(), job.output()[-4000:]
    assert not cluster.active_jobs()


@pytest.mark.slow
def test_an_allocation_with_fewer_gpus_than_processes_fails_in_one_line(cluster, patched_tree, demo_data, offline_env,
                                                                       tmp_path):
    job = submit_training(cluster, 'single-node.sbatch', patched_tree, tmp_path, demo_data, EPOCHS,
                          {**offline_env, 'YOLOV9_DDP_NPROC': '3'})
    fields = job.wait_until_ended(120)
    assert (fields.get('JobState'), fields.get('ExitCode'), fields.get('Restarts')) == ('FAILED', '2:0', '0'), fields
    assert job.output().splitlines() == ['single-node.sbatch: error: 3 processes but only 2 GPU(s) in this allocation: '
                                         'ask for --gpus-per-node=3, or set YOLOV9_DDP_NPROC=2 or fewer'], job.output()
    assert not os.path.exists(job.run_dir)
