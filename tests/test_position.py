"""What a checkpoint's position says about where a resume starts (yolov9_ddp.position); the trainings that resume
from positions are in tests/test_same_run.py."""
import pytest
import torch

from yolov9_ddp.position import Position, PositionMismatch, describe, record, restore_rank_state, resume_point


def checkpoint_at(position: Position) -> dict:
    return {'epoch': position.epoch - 1, 'position': record(position)}


def test_a_position_resumes_at_its_step_and_says_so_in_one_line():
    saved = Position(3, 7, last_opt_step=1506, accumulate=4, best_epoch=2, images=40, global_batch=8)
    start = resume_point(checkpoint_at(saved), images=40, global_batch=8, source='last.pt')
    assert start == saved
    assert describe(start, 250, 'last.pt') == 'resuming epoch 3 at step 7 of 250 from last.pt'


def test_a_checkpoint_of_an_earlier_kit_resumes_at_the_next_epoch_and_says_why():
    start = resume_point({'epoch': 4}, images=40, global_batch=8, source='old.pt')
    assert (start.epoch, start.step, start.recorded) == (5, 0, False)
    assert describe(start, 250, 'old.pt') == ('resuming epoch 5 at its start: old.pt is a checkpoint of an earlier '
                                              'kit, which records no step')


@pytest.mark.parametrize('images, batch, fragment', [
    (39, 8, 'last.pt was recorded on 40 training images, the dataset now has 39: its position (epoch 1, step 3) '
            'does not fit'),
    (40, 16, 'last.pt was recorded with a global batch of 8, this run has 16')])
def test_a_position_that_does_not_fit_the_run_is_refused_in_one_line(images, batch, fragment):
    with pytest.raises(PositionMismatch) as refused:
        resume_point(checkpoint_at(Position(1, 3, images=40, global_batch=8)), images, batch, 'last.pt')
    assert str(refused.value) == fragment


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
