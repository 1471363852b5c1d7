"""The performance levers: the ones that change how the math is done must not change the math, and a run's levers
are an option recorded with it (opt.yaml, checkpoints) that a resume keeps."""
import shutil
import sys
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch
import yaml

from testsupport import faults
from testsupport.jobs import launch_cmd, run, train_args
from testsupport.trees import describe as describe_result
from yolov9_ddp import checkpoint, cli, graphs
from yolov9_ddp.levers import (DETERMINISTIC, ONE_GPU_DEFAULTS, Levers, describe, fused_optimizer, levers_for,
                               parse_levers, record_levers, requested_levers, resumed_levers)
from yolov9_ddp.progress import LaggingLosses
from yolov9_ddp.tasks import TASKS


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


# where this machine has CUDA, the test runs there too (the GPU machine: bench/PLAN.md): CUDA's multi-tensor kernels
# must round as its single-tensor ones
DEVICES = ['cpu', *(['cuda'] if torch.cuda.is_available() else [])]


@pytest.mark.usefixtures('upstream_importable')
@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('validated_between', [False, True])
def test_ema_multi_tensor_update_is_upstreams_bit_for_bit(validated_between, device):
    """validated_between: val_dual's model.half() then model.float() (CUDA, AMP) replace the EMA's tensors; the
    updates after it must still move the EMA (they did not: the EMA stayed frozen after the first validation).
    Bit for bit, as --deterministic keeps the multi-tensor update (a lerp differed in the last bits)."""
    from utils.torch_utils import ModelEMA
    from yolov9_ddp.ema import EmaUpdater
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 4, 1))
    model.to(device)
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
        assert torch.equal(b, a), name
    assert not torch.equal(kit.ema[0].weight, model[0].weight), 'the EMA lags the model'


def test_the_progress_bar_shows_the_losses_the_update_before_sent_and_the_epochs_last_its_own():
    """yolov9_ddp.progress: no update reads a loss the moment it is computed (on a GPU, a wait for all queued work)."""
    progress, means = LaggingLosses(), [torch.tensor([float(i), i / 2]) for i in range(4)]
    shown = [progress.shown(means[0], last=False), progress.shown(means[1], last=False)]
    means[1] += 100  # what the update sent is a copy
    shown += [progress.shown(means[2], last=False), progress.shown(means[3], last=True)]
    assert shown == [None, [0.0, 0.0], [1.0, 0.5], [3.0, 1.5]]


def test_lever_flags_are_parsed_and_checked():
    assert parse_levers('pin_memory=0, progress_every=5') == {'pin_memory': False, 'progress_every': 5}
    with pytest.raises(ValueError, match='unknown lever'):
        parse_levers('turbo=1')
    with pytest.raises(ValueError, match='takes 0 or 1'):
        parse_levers('pin_memory=yes')
    with pytest.raises(ValueError, match='whole number >= 1'):
        parse_levers('progress_every=0')


def options(levers=None, channels_last=False, compile=False, deterministic=False) -> Namespace:
    return Namespace(levers=levers, channels_last=channels_last, compile=compile, deterministic=deterministic)


def test_deterministic_turns_off_the_levers_that_change_the_math_and_refuses_one_turned_on(tmp_path):
    assert levers_for(options(deterministic=True)) == replace(Levers(), **DETERMINISTIC)
    agreeing = levers_for(options('cudnn_benchmark=0,progress_every=5', deterministic=True))
    assert agreeing == replace(Levers(), **DETERMINISTIC, progress_every=5)
    opt = cli.parse_args(['--deterministic', '--levers', 'pin_memory=0,fused_optimizer=1'], tmp_path,
                         TASKS['detect-dual'])
    with pytest.raises(cli.UsageError) as refused:
        cli.check_options(opt, 1, TASKS['detect-dual'])
    assert str(refused.value) == ("--deterministic trains with upstream's numerics, fused_optimizer=0; "
                                  '--levers fused_optimizer=1 contradicts it: give one of the two')
    with pytest.raises(ValueError, match='--channels-last contradicts it'):
        levers_for(options(channels_last=True, deterministic=True))


def test_channels_last_is_short_for_the_lever_which_wins():
    assert levers_for(options(channels_last=True)) == replace(Levers(), channels_last=True)
    assert levers_for(options('channels_last=0', channels_last=True)).channels_last is False


@pytest.mark.parametrize('asked', [options(compile=True), options('compile=1')])
def test_compile_was_measured_not_to_pay_and_is_refused_with_why(asked):
    with pytest.raises(ValueError, match=r'compile: torch.compile does not pay .*\(bench/RESULTS.md\)'):
        levers_for(asked)


def test_a_run_that_recorded_compile_resumes_without_it_and_says_so():
    said = []
    resumed = resumed_levers({'levers': 'compile=1,pin_memory=0', 'compile': True}, {}, said.append)
    assert parse_levers(resumed) == asdict(replace(Levers(), pin_memory=False))
    assert said == ["the run recorded the lever 'compile', which this kit does not have: ignored"]


def test_cuda_graphs_is_refused_in_one_line_where_it_cannot_work(tmp_path, monkeypatch):
    def refusal(*args, world=1):
        opt = cli.parse_args(['--levers', 'cuda_graphs=1', *args], tmp_path, TASKS['detect-dual'])
        with pytest.raises(cli.UsageError) as refused:
            cli.check_options(opt, world, TASKS['detect-dual'])
        return str(refused.value)
    assert refusal('--device', 'cpu') == '--levers cuda_graphs=1 needs a CUDA device'
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)  # the rules past the device
    assert refusal('--device', 'cpu') == '--levers cuda_graphs=1 needs a CUDA device'
    assert 'one GPU only' in refusal('--device', '0,1', world=2)
    for flag in ('--multi-scale', '--rect'):
        assert refusal(flag).endswith('needs one input shape for the run: not with --multi-scale or --rect')
    assert 'not offered with --deterministic' in refusal('--device', '0', '--deterministic')
    assert graphs.unsupported(cli.parse_args(['--device', '0'], tmp_path, TASKS['detect-dual']), 1) == ''


def test_a_lever_that_would_change_nothing_in_the_run_is_refused_in_one_line(tmp_path):
    def refusal(task, *args):
        with pytest.raises(cli.UsageError) as refused:
            cli.check_options(cli.parse_args(list(args), tmp_path, TASKS[task]), 1, TASKS[task])
        return str(refused.value)

    def checked(task, *args):  # where it acts: no refusal
        opt = cli.parse_args(list(args), tmp_path, TASKS[task])
        cli.refuse_levers_without_effect(levers_for(opt), opt, TASKS[task])
    for name in ('host_targets', 'dense_box_loss'):
        assert refusal('segment-dual', '--levers', f'{name}=1') == (
            f"--levers {name}=1 is for the detection losses; segment/ddp_train_dual.py trains with upstream's "
            f"segmentation loss, which has no use for it")
        checked('detect-triple', '--levers', f'{name}=1')
    assert refusal('detect', '--levers', 'fill_uninitialized=1').startswith(
        '--levers fill_uninitialized=1 acts under --deterministic only')
    checked('detect', '--deterministic', '--levers', 'fill_uninitialized=1')


def test_a_new_run_on_one_gpu_takes_the_one_gpu_defaults_unless_told_otherwise(tmp_path, monkeypatch):
    def levers(*args, world=1, task='detect-dual'):
        opt = cli.parse_args(list(args), tmp_path, TASKS[task])
        return levers_for(opt, graphs.one_gpu_defaults(opt, world, TASKS[task]))
    assert levers('--device', '0') == Levers(), 'no CUDA here'
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    graphs_and_writer = dict(cuda_graphs=True, resident_grads=True, channels_last=True, checkpoint_process=True)
    assert levers('--device', '0') == replace(Levers(), **ONE_GPU_DEFAULTS) == replace(
        Levers(), **graphs_and_writer, host_targets=True, dense_box_loss=True)
    assert levers('--device', '0', task='segment-dual') == replace(Levers(), **graphs_and_writer), \
        'the loss levers only where the loss takes them'
    assert levers('--device', 'cpu') == levers('--device', '0,1', world=2) == Levers()
    assert levers('--device', '0', '--resume') == Levers(), "a resume keeps the run's own (recorded) levers"
    without_graphs = replace(Levers(), channels_last=True, checkpoint_process=True, host_targets=True,
                             dense_box_loss=True)  # resident_grads goes with the graphs, whose clones it takes out
    assert levers('--device', '0', '--multi-scale') == without_graphs
    assert levers('--device', '0', '--batch-size', '-1') == without_graphs, 'AutoBatch'
    assert levers('--device', '0', '--levers', 'channels_last=0,dense_box_loss=0,checkpoint_process=0') == replace(
        Levers(), cuda_graphs=True, resident_grads=True, host_targets=True)
    assert levers('--device', '0', '--deterministic') == replace(Levers(), **DETERMINISTIC, checkpoint_process=True), \
        'upstream\'s numerics, and host_targets, which alone did not pay, left out with dense_box_loss'
    assert levers('--device', '0', '--deterministic', '--levers', 'host_targets=1') == replace(
        Levers(), **DETERMINISTIC, checkpoint_process=True, host_targets=True)


def test_a_runs_cuda_graphs_turns_off_in_one_line_where_a_resume_cannot_use_it(tmp_path, monkeypatch):
    opt = cli.parse_args(['--device', 'cpu'], tmp_path, TASKS['detect-dual'])
    opt.levers, said = describe(replace(Levers(), cuda_graphs=True, progress_every=3)), []
    assert parse_levers(graphs.off_where_unsupported(opt, 1, {}, said.append)) == asdict(
        replace(Levers(), progress_every=3))
    assert said == ['levers changed on resume: cuda_graphs 1 -> 0, as this start cannot use it (cuda_graphs=1 needs '
                    'a CUDA device); a resume on one GPU turns it on again with --levers cuda_graphs=1']
    assert graphs.off_where_unsupported(opt, 1, {'cuda_graphs': True}, said.append) == opt.levers, \
        'given on the command line it is left to cli.check_options, which refuses it'
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    opt.device = '0'
    assert graphs.off_where_unsupported(opt, 1, {}, said.append) == opt.levers and len(said) == 1, 'one GPU: kept'
    assert parse_levers(graphs.off_where_unsupported(opt, 2, {}, said.append))['cuda_graphs'] is False
    assert 'one GPU only' in said[-1]


@pytest.mark.usefixtures('upstream_importable')
def test_a_run_trained_with_cuda_graphs_resumes_on_cpus_without_them(tmp_path, monkeypatch):
    """A run started on one GPU with --levers cuda_graphs=1 continues on CPUs or on 2 processes (issue 21): its
    recorded lever turns off for this start, it is not refused."""
    from yolov9_ddp import runs, trainer
    task = TASKS['detect-dual']
    recorded = {**vars(cli.parse_args(['--device', '0', '--levers', 'cuda_graphs=1'], tmp_path, task)),
                'levers': describe(replace(Levers(), cuda_graphs=True))}
    plan = runs.RunPlan(tmp_path / 'exp', resume_from=tmp_path / 'exp' / 'weights' / 'last.pt', options=recorded)
    argv = ['--resume', str(plan.resume_from), '--device', 'cpu']
    opt, said = cli.parse_args(argv, tmp_path, task), []
    monkeypatch.setattr(trainer.LOGGER, 'info', said.append)
    trainer.restore_resumed_options(opt, plan, cli.given_flags(argv, tmp_path, task))
    assert parse_levers(opt.levers)['cuda_graphs'] is False and opt.device == 'cpu'
    assert [line for line in said if 'cuda_graphs 1 -> 0' in line]
    cli.check_options(opt, 1, task)  # what refused the resume before: '--levers cuda_graphs=1 needs a CUDA device'


@pytest.mark.usefixtures('upstream_importable')
def test_autobatch_measures_with_cudnn_benchmark_off_and_turns_it_on_again(monkeypatch):
    """Upstream's autobatch() answers 16 without measuring while cudnn.benchmark is on, and it is the kit's
    default: --batch-size -1 did nothing on a GPU."""
    from yolov9_ddp import trainer
    measured_with = []
    monkeypatch.setattr(trainer, 'check_train_batch_size',
                        lambda model, imgsz, amp: measured_with.append(torch.backends.cudnn.benchmark) or 48)
    monkeypatch.setattr(torch.backends.cudnn, 'benchmark', True)
    assert trainer.autobatch(torch.nn.Identity(), 640, True) == 48 and measured_with == [False]
    assert torch.backends.cudnn.benchmark, 'the lever is on again for training'


def test_graph_captures_check_the_training_threads_cuda_calls_only(monkeypatch):
    """The loader's pin-memory thread must not invalidate the training thread's capture (graphs.capture_graphs):
    what make_graphed_callables gives torch.cuda.graph for its captures, recorded instead of captured (no CUDA)."""
    given, default = [], torch.cuda.graph
    monkeypatch.setattr(torch.cuda.graph, '__init__', lambda self, cuda_graph, **kwargs: given.append(kwargs))

    def make_graphed_callables():  # creates its captures as torch's does, with the mode or without
        torch.cuda.graph(None, pool=None)
        torch.cuda.graph(None, pool=None, capture_error_mode='global')
    with graphs.captures_checking_this_thread():
        make_graphed_callables()
    assert given == [{'pool': None, 'capture_error_mode': 'thread_local'}] * 2
    assert torch.cuda.graph is default


class StaticGradients(torch.autograd.Function):
    """What a replayed CUDA graph's backward does: it hands out the same gradient buffer every time."""

    @staticmethod
    def forward(ctx, x, weight, buffer):
        ctx.save_for_backward(x)
        ctx.buffer = buffer
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        ctx.buffer.copy_(grad.t() @ x)
        return None, ctx.buffer.detach(), None


def static_gradient_capture(model, sample):
    buffer = torch.empty_like(model.weight)
    return lambda x: StaticGradients.apply(x, model.weight, buffer)


@pytest.mark.usefixtures('upstream_importable')
def test_cuda_graphs_accumulates_gradients_over_micro_steps_as_eager_with_resident_gradients_too():
    """A .grad that took the replay's buffer over would add the next micro-step's gradient to itself (found on an
    H200: bench/RESULTS.md, "Lever: CUDA graphs"), unless each gradient is cloned on its way or, with the lever
    resident_grads, backward adds into a .grad that the optimizer zeroed in place (Trainer.zero_grad): two optimizer
    steps of two micro-steps each, their gradients the eager ones; the clones go once the gradients are resident."""
    from yolov9_ddp.trainer import Trainer
    torch.manual_seed(0)
    model, batches = torch.nn.Linear(4, 3, bias=False), [torch.randn(5, 4) for _ in range(4)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0)

    def accumulated(forward, levers=Levers()):
        trainer = SimpleNamespace(optimizer=optimizer, levers=levers, forward=forward)
        model.weight.grad, sums = None, []
        for step in (0, 1):
            for batch in batches[2 * step:2 * step + 2]:
                forward(batch).square().sum().backward()
            sums.append(model.weight.grad.clone())
            Trainer.zero_grad(trainer)
        return sums
    eager = accumulated(model)
    cloned = graphs.GraphedModel(model, capture=static_gradient_capture)
    assert all(map(torch.equal, accumulated(cloned, replace(Levers(), cuda_graphs=True)), eager))
    assert list(cloned.clones) == [model.weight] and model.weight.grad is None, 'zeroed by freeing, cloned'
    cloned.clones.pop(model.weight).remove()  # the weight is wrapped again below: one clone hook at a time
    resident = graphs.GraphedModel(model, capture=static_gradient_capture)
    assert all(map(torch.equal, accumulated(resident, replace(Levers(), cuda_graphs=True, resident_grads=True)), eager))
    assert resident.clones == {} and torch.equal(model.weight.grad, torch.zeros(3, 4)), 'zeroed in place, no clone'


def test_a_run_records_every_lever_in_its_options():
    opt = options('cudnn_benchmark=0,progress_every=3')
    levers = record_levers(opt)
    assert levers == replace(Levers(), cudnn_benchmark=False, progress_every=3)
    assert parse_levers(opt.levers) == asdict(levers), 'the record names every lever, not only the changed ones'
    assert levers_for(opt) == levers


def test_a_resume_keeps_the_recorded_levers_and_changes_only_those_given():
    recorded = {'levers': describe(replace(Levers(), foreach_ema=False, progress_every=3)), 'channels_last': False}
    said = []
    assert resumed_levers(recorded, {}, said.append) == recorded['levers'] and said == []
    resumed = resumed_levers(recorded, requested_levers(options('progress_every=5', channels_last=True)), said.append)
    assert parse_levers(resumed) == asdict(replace(Levers(), foreach_ema=False, progress_every=5, channels_last=True))
    assert said == ['levers changed on resume: progress_every 3 -> 5, channels_last 0 -> 1']


def test_a_resume_of_a_run_from_before_recorded_levers_keeps_its_flags():
    said = []
    resumed = resumed_levers({'channels_last': True, 'compile': False}, {}, said.append)
    assert parse_levers(resumed) == asdict(replace(Levers(), channels_last=True)) and said == []


def test_a_recorded_lever_this_kit_no_longer_has_is_ignored_with_a_warning():
    said = []
    resumed = resumed_levers({'levers': 'warp_drive=1,pin_memory=0'}, {}, said.append)
    assert parse_levers(resumed) == asdict(replace(Levers(), pin_memory=False))
    assert said == ["the run recorded the lever 'warp_drive', which this kit does not have: ignored"]


@pytest.mark.usefixtures('upstream_importable')
def test_a_run_that_recorded_the_retired_levers_off_resumes_without_a_word(tmp_path, monkeypatch):
    """act_out_of_place, graphed_loss and one_cpu_thread were removed (levers.RETIRED) after the runs of earlier kits
    had recorded them, off (their default) except in the runs that measured them: off they changed nothing, so a
    resume drops them silently; one recorded on is warned about, as any lever this kit does not have. Given on a
    command line they are unknown."""
    from yolov9_ddp import runs, trainer
    task = TASKS['detect-dual']
    recorded = {**vars(cli.parse_args(['--device', 'cpu'], tmp_path, task)),
                'levers': f'{describe(Levers())},act_out_of_place=0,graphed_loss=0,one_cpu_thread=0'}  # as runs did
    plan = runs.RunPlan(tmp_path / 'exp', resume_from=tmp_path / 'exp' / 'weights' / 'last.pt', options=recorded)
    argv = ['--resume', str(plan.resume_from)]
    opt, said = cli.parse_args(argv, tmp_path, task), []
    monkeypatch.setattr(trainer.LOGGER, 'info', said.append)
    trainer.restore_resumed_options(opt, plan, cli.given_flags(argv, tmp_path, task))
    assert opt.levers == describe(Levers()) and said == []
    cli.check_options(opt, 1, task)
    assert resumed_levers({'levers': 'graphed_loss=1,one_cpu_thread=0'}, {}, said.append) == describe(Levers())
    assert said == ["the run recorded the lever 'graphed_loss', which this kit does not have: ignored"]
    with pytest.raises(ValueError, match="unknown lever 'one_cpu_thread'"):
        levers_for(options('one_cpu_thread=0'))


def final_weights(tree, data, project, levers_on: bool) -> dict:
    """The model and EMA tensors after one epoch of a 1-process run on the CPU (weights/epoch0.pt, unstripped), with
    the levers fill_uninitialized, host_targets and resident_grads on or off."""
    on = int(levers_on)
    result = run([sys.executable, 'ddp_train_dual.py', *map(str, train_args(
        data, project, 1, 4, 64, '--workers', 1, '--save-period', 1, '--deterministic',
        '--levers', f'fill_uninitialized={on},host_targets={on},resident_grads={on}'))], tree)
    assert result.returncode == 0, describe_result(result)
    said = result.stdout + result.stderr
    assert '--deterministic: levers cudnn_benchmark=0, fused_optimizer=0' in said
    assert f'fill_uninitialized_memory={levers_on},' in said
    saved = checkpoint.load_checkpoint(project / 'exp' / 'weights' / 'epoch0.pt')
    assert yaml.safe_load((project / 'exp' / 'opt.yaml').read_text())['deterministic'] is True
    return {f'{part}.{name}': tensor for part in ('model', 'ema')
            for name, tensor in saved[part].float().state_dict().items()}


@pytest.mark.usefixtures('upstream_importable')
@pytest.mark.slow
def test_two_deterministic_runs_one_with_torchs_fill_of_new_tensors_end_with_bit_identical_weights(
        patched_tree, demo_data, tmp_path):
    """The second run has torch's fill of uninitialised memory (NaN in every new tensor), which the kit turns off
    (levers.use_deterministic_algorithms): a read of memory never written would differ between them, or be NaN.
    It also gives the loss the loader's targets (host_targets=1), which its patched loss pads where they are, and
    zeroes the gradients in place between optimizer steps (resident_grads=1), where backward then adds into them."""
    with ThreadPoolExecutor(2) as pool:  # side by side: the test holds both cores
        first, again = pool.map(lambda second: final_weights(patched_tree, demo_data, tmp_path / str(second), second),
                                (False, True))
    assert first.keys() == again.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), f'{name} differs between two --deterministic runs'


# -- recorded with a real run, kept by its resume ---------------------------------------------------------------

RUN_LEVERS = 'progress_every=3,foreach_ema=0,dense_box_loss=1'  # the run trains with the box loss over every anchor
RECORDED = describe(replace(Levers(), progress_every=3, foreach_ema=False, dense_box_loss=True))


@pytest.fixture(scope='module')
def interrupted_with_levers(patched_tree, demo_data, tmp_path_factory):
    """A 2-process run started with --levers, killed at the start of its last epoch."""
    return faults.interrupted_run(patched_tree, demo_data, tmp_path_factory.mktemp('levers'),
                                  extra=('--levers', RUN_LEVERS))


def recorded_levers(run_dir) -> tuple:
    """The levers in the run's opt.yaml and in its last.pt."""
    saved = yaml.safe_load((run_dir / 'opt.yaml').read_text())['levers']
    return saved, checkpoint.load_checkpoint(run_dir / 'weights' / 'last.pt')['opt']['levers']


@pytest.mark.usefixtures('upstream_importable')
@pytest.mark.parametrize('given, expected, change', [
    ((), RECORDED, None),
    (('--levers', 'progress_every=5', '--channels-last'),
     describe(replace(Levers(), progress_every=5, foreach_ema=False, dense_box_loss=True, channels_last=True)),
     'levers changed on resume: progress_every 3 -> 5, channels_last 0 -> 1')])
@pytest.mark.slow
def test_a_resume_trains_with_the_runs_levers_unless_given_again(patched_tree, interrupted_with_levers, tmp_path,
                                                                  given, expected, change):
    assert recorded_levers(interrupted_with_levers) == (RECORDED, RECORDED)
    run_dir = shutil.copytree(interrupted_with_levers, tmp_path / 'runs' / 'exp')
    resume = launch_cmd(1, faults.FAULTY, '--resume', run_dir / 'weights' / 'last.pt', '--device', 'cpu',
                        '--workers', 0, *given)
    job = faults.start_job(resume, patched_tree, tmp_path, 'resumed')
    assert job.wait(300) == 0, job.output()[-3000:]
    assert recorded_levers(run_dir) == (expected, expected)
    changes = [line for line in job.output().splitlines() if 'levers changed' in line]
    assert changes == ([] if change is None else [change]), changes
