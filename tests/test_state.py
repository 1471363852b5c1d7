"""A run's resumable state (yolov9_ddp.state.RunState): what its checkpoint records and where a resume starts; the
trainings that resume from it are in tests/test_same_run.py and tests/test_ddp_resume.py."""
import pytest
import torch

from yolov9_ddp.state import PositionMismatch, RunState, restore_rank_state, scaler_state


class Stopper:  # upstream's EarlyStopping, as far as the state holds it
    best_fitness, best_epoch = 0.0, 0


class Ema:
    updates = 0


def run_state(images=40, global_batch=8) -> RunState:
    return RunState(torch.amp.GradScaler('cpu', init_scale=1024.0), Ema(), Stopper(), images, global_batch, world=2,
                    accumulate=8)


def test_a_state_resumes_at_its_position_with_its_counters_and_says_so_in_one_line():
    saved = run_state()
    saved.last_opt_step, saved.accumulate, saved.best_fitness = 1506, 4, 0.25
    saved.ema.updates, saved.stopper.best_epoch = 180, 2
    ckpt = saved.state_dict(3, 7, ranks=['rank 0', 'rank 1'])
    assert ckpt['epoch'] == 2, "upstream's: the last complete epoch"
    resumed = run_state()
    resumed.load_state_dict(ckpt, 'last.pt')
    assert (resumed.epoch, resumed.step, resumed.last_opt_step, resumed.accumulate) == (3, 7, 1506, 4)
    assert (resumed.best_fitness, resumed.stopper.best_fitness, resumed.stopper.best_epoch) == (0.25, 0.25, 2)
    assert resumed.ema.updates == 180 and resumed.ranks == ['rank 0', 'rank 1']
    assert resumed.scaler.state_dict() == saved.scaler.state_dict()
    assert resumed.describe(250, 'last.pt') == 'resuming epoch 3 at step 7 of 250 from last.pt'


def test_a_checkpoint_without_a_position_as_upstreams_resumes_at_the_next_epoch_and_says_why():
    resumed = run_state()
    resumed.load_state_dict({'epoch': 4, 'updates': 9}, 'old.pt')
    assert (resumed.epoch, resumed.step, resumed.recorded) == (5, 0, False)
    assert resumed.describe(250, 'old.pt') == 'resuming epoch 5 at its start: old.pt records no step'


@pytest.mark.parametrize('images, batch, fragment', [
    (39, 8, 'last.pt was recorded on 40 training images, the dataset now has 39: its position (epoch 1, step 3) '
            'does not fit'),
    (40, 16, 'last.pt was recorded with a global batch of 8, this run has 16')])
def test_a_position_that_does_not_fit_the_run_is_refused_in_one_line(images, batch, fragment):
    with pytest.raises(PositionMismatch) as refused:
        run_state(images, batch).load_state_dict(run_state().state_dict(1, 3), 'last.pt')
    assert str(refused.value) == fragment


def test_a_disabled_scaler_records_its_state_as_upstream_does():
    disabled = torch.amp.GradScaler('cuda', enabled=False)
    assert scaler_state(disabled) == disabled.state_dict() == {}


def bn_model(value: float):
    model = torch.nn.BatchNorm2d(2)
    model.running_mean.fill_(value)
    return model


def test_each_rank_takes_its_own_statistics_back_and_another_world_size_their_mean():
    ranks = [{'norm': [torch.full((2,), v), torch.ones(2)], 'ema_norm': [torch.full((2,), 10 * v), torch.ones(2)],
              'mean_loss': torch.tensor([v])} for v in (1.0, 3.0)]
    model, ema = bn_model(0), bn_model(0)
    assert restore_rank_state(ranks, 1, 2, model, ema).item() == 3.0
    assert model.running_mean.tolist() == [3.0, 3.0] and ema.running_mean.tolist() == [30.0, 30.0]
    restore_rank_state(ranks, 0, 3, model, ema)
    assert model.running_mean.tolist() == [2.0, 2.0] and ema.running_mean.tolist() == [20.0, 20.0]
