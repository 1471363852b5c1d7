"""The performance levers that change how the math is done must not change the math."""

import pytest
import torch

from yolov9_ddp.levers import fused_optimizer, parse_overrides


def sgd_groups(params):
    # upstream's smart_optimizer: SGD with nesterov momentum, three groups with different weight decay
    optimizer = torch.optim.SGD([params[0]], lr=0.01, momentum=0.937, nesterov=True)
    optimizer.add_param_group({'params': [params[1]], 'weight_decay': 5e-4})
    optimizer.add_param_group({'params': [params[2]], 'weight_decay': 0.0})
    return optimizer


def train(optimizer, params, scaler, losses):
    for scale in losses:
        loss = sum((p * scale).pow(2).sum() for p in params)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def test_fused_sgd_matches_upstream_sgd_when_amp_skips_the_first_step():
    # The first step overflows (the scaler skips it), as AMP's first steps often do; torch's fused SGD then
    # kept its uninitialised momentum buffers and wrote garbage into the weights on the next step.
    torch.manual_seed(0)
    start = [torch.randn(64) for _ in range(3)]
    results = []
    for make in (lambda o: o, fused_optimizer):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = make(sgd_groups(params))
        scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 127)  # the first scaled loss overflows
        train(optimizer, params, scaler, [1.0, 1.0, 0.5, 2.0])
        results.append(torch.cat([p.detach() for p in params]))
    unfused, fused = results
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-7)
    assert not torch.equal(unfused, torch.cat(start)), 'the steps after the skipped one must move the weights'


@pytest.mark.usefixtures('upstream_importable')
@pytest.mark.parametrize('validated_between', [False, True])
def test_ema_multi_tensor_update_equals_upstreams(validated_between):
    """validated_between: val_dual's model.half() then model.float() (CUDA, AMP) replace the EMA's tensors; the
    updates after it must still move the EMA (they did not: the EMA stayed frozen after the first validation)."""
    from utils.torch_utils import ModelEMA
    from yolov9_ddp.ema import EmaUpdater
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 4, 1))
    upstream, kit = ModelEMA(model), ModelEMA(model)
    update = EmaUpdater(kit, model, foreach=True)
    for step in range(5):
        if validated_between and step == 2:
            for ema in (upstream, kit):
                ema.ema.half()
                ema.ema.float()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model[1].running_mean.add_(1.0)
        upstream.update(model)
        update(model)
    assert kit.updates == upstream.updates == 5
    for (name, a), b in zip(upstream.ema.state_dict().items(), kit.ema.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_lever_overrides_are_parsed_and_checked():
    assert parse_overrides('pin_memory=0, progress_every=5') == {'pin_memory': False, 'progress_every': 5}
    with pytest.raises(ValueError, match='unknown lever'):
        parse_overrides('turbo=1')
    with pytest.raises(ValueError, match='takes 0 or 1'):
        parse_overrides('pin_memory=yes')
