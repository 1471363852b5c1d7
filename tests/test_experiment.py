"""One experiment log across the starts of a run (yolov9_ddp.experiment): results.csv and TensorBoard's event files in
the run folder show each epoch's metrics once, and W&B (the real package, offline: no server, no account) continues
the run's one W&B run, logged by rank 0 alone. One 2-process job, whose rank 0 is killed while it writes epoch 0's
checkpoint: torchrun's restart starts the run over in the same folder, where the first start logged epoch 0 already.
The job is also the proof that torchrun's restart of a killed job resumes the run by itself and completes it in one
folder."""
import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from testsupport.faults import completed_run_problems, faulty_torchrun, fault_args, results_epochs, start_job
from testsupport.injected import Fault

pytestmark = [pytest.mark.slow, pytest.mark.cores, pytest.mark.usefixtures('upstream_importable')]
EPOCHS = 2


@pytest.fixture(scope='module')
def restarted(patched_tree, demo_data, tmp_path_factory):
    """(the run folder, W&B's folder, the job's output) of a job restarted once."""
    workdir = tmp_path_factory.mktemp('experiment')
    wandb = workdir / 'wandb-home'
    job = start_job(faulty_torchrun(2, fault_args(demo_data, workdir / 'runs', EPOCHS, '--noplots'), 1),
                    patched_tree, workdir, 'job', Fault('kill', rank=0, where='save', epoch=0),
                    WANDB_MODE='offline', WANDB_DIR=wandb, WANDB_CONFIG_DIR=wandb, WANDB_CACHE_DIR=wandb)
    assert job.wait(300) == 0, job.output()[-4000:]
    run_dir = workdir / 'runs' / 'exp'
    assert completed_run_problems(run_dir.parent, EPOCHS) == []
    assert results_epochs(run_dir) == [0, 1], 'epoch 0 logged once, though trained again after the kill'
    return run_dir, wandb / 'wandb', job.output()


def test_tensorboard_shows_each_epochs_metrics_once_after_a_restart(restarted):
    run_dir, _, output = restarted
    assert 'torchrun restart 1: continuing' in output
    log = EventAccumulator(str(run_dir))
    log.Reload()
    assert [event.step for event in log.Scalars('train/box_loss')] == list(range(EPOCHS))
    assert [event.step for event in log.Scalars('metrics/mAP_0.5')] == list(range(EPOCHS))


def test_wandb_continues_the_runs_one_wandb_run_from_rank_0_alone(restarted):
    run_dir, wandb, _ = restarted
    run_id = json.loads((run_dir / 'run.json').read_text())['wandb_id']
    starts = sorted(path.name for path in Path(wandb).glob('offline-run-*'))
    assert len(starts) == 2 and all(name.endswith(f'-{run_id}') for name in starts), starts
