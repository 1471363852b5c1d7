"""The performance choices (yolov9_ddp.perf): what changes how the math is done must not change the math, the five
switches are checked where they cannot act, and a run's switches are an option recorded with it (opt.yaml,
checkpoints) that a resume keeps, a run of kit 0.6.0 included."""
import copy
import shutil
from argparse import Namespace
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch
import yaml

from testsupport import faults
from testsupport.jobs import launch_cmd
from yolov9_ddp import checkpoints, cli, graphs, perf
from yolov9_ddp.perf import DETERMINISTIC, ONE_GPU_DEFAULTS, Perf
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
    # The first step overflows (the scaler skips it), as AMP's first steps often do; torch's fused SGD can then
    # keep its uninitialised momentum buffers and write garbage into the weights on the next step.
    torch.manual_seed(0)
    start = [torch.randn(64) for _ in range(3)]
    results = []
    for make in (lambda o: o, perf.fused):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = make(sgd_groups(params))
        scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 127)  # the first scaled loss overflows
        train(optimizer, params, scaler, [1.0, 1.0, 0.5, 2.0])
        results.append(torch.cat([p.detach() for p in params]))
    unfused, fused = results
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-7)
    assert not torch.equal(unfused, torch.cat(start)), 'the steps after the skipped one must move the weights'


# where this machine has CUDA, the test runs there too: CUDA's multi-tensor kernels must round as its single-tensor
# ones
DEVICES = ['cpu', *(['cuda'] if torch.cuda.is_available() else [])]


@pytest.mark.usefixtures('upstream_importable')
@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('validated_between', [False, True])
def test_ema_multi_tensor_update_is_upstreams_bit_for_bit(validated_between, device):
    """validated_between: val_dual's model.half() then model.float() (CUDA, AMP) replace the EMA's tensors; the
    updates after it must still move the EMA (an update of the replaced tensors would leave it frozen after the
    first validation). Bit for bit, as --deterministic keeps the multi-tensor update (a lerp differs in the last
    bits)."""
    from utils.torch_utils import ModelEMA
    from yolov9_ddp.ema import EmaUpdater
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 4, 1))
    model.to(device)
    upstream, kit = ModelEMA(model), ModelEMA(model)
    update = EmaUpdater(kit, model)
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


def requested(levers=None, channels_last=False, compile=False, deterministic=False) -> Perf:
    return replace(Perf(), **perf.requested(Namespace(levers=levers, channels_last=channels_last, compile=compile,
                                                      deterministic=deterministic)))


def test_the_switches_are_parsed_and_checked():
    assert perf.parse('cuda_graphs=1, cudnn_benchmark=0') == {'cuda_graphs': True, 'cudnn_benchmark': False}
    with pytest.raises(ValueError, match="unknown lever 'pin_memory'"):  # always on: not a switch
        perf.parse('pin_memory=0')
    with pytest.raises(ValueError, match='takes 0 or 1'):
        perf.parse('channels_last=yes')


def test_deterministic_turns_off_the_switches_that_change_the_math_and_refuses_one_turned_on(tmp_path):
    assert requested(deterministic=True) == replace(Perf(), **DETERMINISTIC)
    assert requested('cudnn_benchmark=0', deterministic=True) == replace(Perf(), **DETERMINISTIC)
    opt = cli.parse_args(['--deterministic', '--levers', 'cudnn_benchmark=0,fused_optimizer=1'], tmp_path,
                         TASKS['detect-dual'])
    with pytest.raises(cli.UsageError) as refused:
        cli.check_options(opt, 1, TASKS['detect-dual'])
    assert str(refused.value) == ("--deterministic trains with upstream's numerics, fused_optimizer=0; "
                                  '--levers fused_optimizer=1 contradicts it: give one of the two')
    with pytest.raises(ValueError, match='--channels-last contradicts it'):
        requested(channels_last=True, deterministic=True)


def test_channels_last_is_short_for_the_switch_which_wins():
    assert requested(channels_last=True) == replace(Perf(), channels_last=True)
    assert requested('channels_last=0', channels_last=True).channels_last is False


@pytest.mark.parametrize('asked', [dict(compile=True), dict(levers='compile=1')])
def test_compile_was_measured_not_to_pay_and_is_refused_with_why(asked):
    with pytest.raises(ValueError, match=r'compile: torch.compile does not pay .*\(docs/benchmarks.md\)'):
        requested(**asked)


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
    assert perf.graphs_unsupported(cli.parse_args(['--device', '0'], tmp_path, TASKS['detect-dual']), 1) == ''


def test_dense_box_loss_is_refused_in_one_line_where_the_loss_has_no_use_for_it(tmp_path):
    opt = cli.parse_args(['--levers', 'dense_box_loss=1'], tmp_path, TASKS['segment-dual'])
    with pytest.raises(cli.UsageError) as refused:
        cli.check_options(opt, 1, TASKS['segment-dual'])
    assert str(refused.value) == ("--levers dense_box_loss=1 is for the detection losses; segment/ddp_train_dual.py "
                                  "trains with upstream's segmentation loss, which has no use for it")
    opt = cli.parse_args(['--levers', 'dense_box_loss=1'], tmp_path, TASKS['detect-triple'])
    assert perf.checked(opt, 1, TASKS['detect-triple']).dense_box_loss


def test_a_new_run_on_one_gpu_takes_the_one_gpu_defaults_unless_told_otherwise(tmp_path, monkeypatch):
    def chosen(*args, world=1, task='detect-dual'):
        return perf.for_run(cli.parse_args(list(args), tmp_path, TASKS[task]), world, TASKS[task])
    assert chosen('--device', '0') == Perf(), 'no CUDA here'
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    heuristics = replace(Perf(), cudnn_benchmark=False)
    assert chosen('--device', '0') == replace(Perf(), **ONE_GPU_DEFAULTS) == replace(
        heuristics, cuda_graphs=True, channels_last=True, dense_box_loss=True)
    assert chosen('--device', '0', task='segment-dual') == replace(heuristics, cuda_graphs=True, channels_last=True), \
        'dense_box_loss only where the loss takes it'
    assert chosen('--device', 'cpu') == chosen('--device', '0,1', world=2) == Perf()
    assert chosen('--device', '0', '--resume') == Perf(), "a resume keeps the run's own (recorded) switches"
    without_graphs = replace(heuristics, channels_last=True, dense_box_loss=True)
    assert chosen('--device', '0', '--multi-scale') == without_graphs
    assert chosen('--device', '0', '--batch-size', '-1') == without_graphs, 'AutoBatch'
    assert chosen('--device', '0', '--levers', 'channels_last=0,dense_box_loss=0') == replace(heuristics,
                                                                                              cuda_graphs=True)
    assert chosen('--device', '0', '--levers', 'cudnn_benchmark=1').cudnn_benchmark
    assert chosen('--device', '0', '--deterministic') == replace(Perf(), **DETERMINISTIC), "upstream's numerics"


def test_a_run_records_every_switch_in_its_options():
    opt = Namespace(levers='cudnn_benchmark=0', channels_last=False, compile=False, deterministic=False,
                    resume=False, device='cpu', batch_size=16)
    chosen = perf.for_run(opt, 1, TASKS['detect-dual'])
    assert chosen == replace(Perf(), cudnn_benchmark=False)
    assert perf.parse(opt.levers) == asdict(chosen), 'the record names every switch, not only the changed ones'


def resumed(recorded: dict, given: dict, device='cpu', world=1, said=None) -> str:
    opt = Namespace(device=device, multi_scale=False, rect=False, deterministic=False)
    return perf.resumed(recorded, given, opt, world, (said if said is not None else []).append)


def test_a_resume_keeps_the_recorded_switches_and_changes_only_those_given():
    recorded = {'levers': replace(Perf(), fused_optimizer=False).describe(), 'channels_last': False}
    said = []
    assert resumed(recorded, {}, said=said) == recorded['levers'] and said == []
    given = perf.requested(Namespace(levers='cudnn_benchmark=0', channels_last=True, compile=False,
                                     deterministic=False))
    assert perf.parse(resumed(recorded, given, said=said)) == asdict(
        replace(Perf(), fused_optimizer=False, cudnn_benchmark=False, channels_last=True))
    assert said == ['levers changed on resume: channels_last 0 -> 1, cudnn_benchmark 1 -> 0']


def test_a_resume_of_a_run_of_kit_0_6_0_drops_its_former_levers_without_a_word():
    """0.6.0 recorded 16 levers; those that are now always on, part of a switch or gone are dropped."""
    recorded_by_0_6_0 = ('pin_memory=1,persistent_workers=1,prefetch_factor=4,fused_optimizer=1,foreach_ema=1,'
                         'bucket_view=1,static_graph=0,progress_every=10,cudnn_benchmark=1,channels_last=1,'
                         'cuda_graphs=1,fill_uninitialized=0,host_targets=1,dense_box_loss=1,checkpoint_process=1,'
                         'resident_grads=1')
    said = []
    assert resumed({'levers': recorded_by_0_6_0}, {}, device='0', said=said) == replace(
        Perf(), channels_last=True, cuda_graphs=False, dense_box_loss=True).describe()
    assert said == ['levers changed on resume: cuda_graphs 1 -> 0, as this start cannot use them (cuda_graphs=1 '
                    'needs a CUDA device); a resume on one GPU turns them on again with --levers cuda_graphs=1']


def test_a_recorded_lever_this_kit_never_had_is_ignored_with_a_warning():
    said = []
    assert resumed({'levers': 'warp_drive=1,cudnn_benchmark=0,compile=1'}, {}, said=said) == replace(
        Perf(), cudnn_benchmark=False).describe()
    assert said == ["the run recorded the lever 'warp_drive', which this kit does not have: ignored",
                    "the run recorded the lever 'compile', which this kit does not have: ignored"]


def test_a_resume_of_a_run_from_before_recorded_levers_keeps_its_flags():
    said = []
    assert perf.parse(resumed({'channels_last': True, 'compile': False}, {}, said=said)) == asdict(
        replace(Perf(), channels_last=True)) and said == []


def test_a_runs_cuda_graphs_turn_off_in_one_line_where_a_resume_cannot_use_them(monkeypatch):
    recorded, said = {'levers': replace(Perf(), cuda_graphs=True).describe()}, []
    assert resumed(recorded, {}, said=said) == Perf().describe() and len(said) == 1
    assert resumed(recorded, {'cuda_graphs': True}, said=said) == recorded['levers'], \
        'given on the command line they are left to cli.check_options, which refuses them'
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    assert resumed(recorded, {}, device='0', said=said) == recorded['levers'] and len(said) == 1, 'one GPU: kept'
    assert perf.parse(resumed(recorded, {}, device='0', world=2, said=said))['cuda_graphs'] is False
    assert 'one GPU only' in said[-1]


@pytest.mark.usefixtures('upstream_importable')
def test_a_run_trained_with_cuda_graphs_resumes_on_cpus_without_them(tmp_path):
    """A run started on one GPU with cuda_graphs continues on CPUs or on 2 processes: its recorded switch turns off
    for this start, it is not refused."""
    from yolov9_ddp import build, runs
    task = TASKS['detect-dual']
    recorded = {**vars(cli.parse_args(['--device', '0', '--levers', 'cuda_graphs=1'], tmp_path, task)),
                'levers': replace(Perf(), cuda_graphs=True).describe()}
    plan = runs.RunPlan(tmp_path / 'exp', resume_from=tmp_path / 'exp' / 'weights' / 'last.pt', options=recorded)
    argv = ['--resume', str(plan.resume_from), '--device', 'cpu']
    opt, said = cli.parse_args(argv, tmp_path, task), []
    build.restore_resumed_options(opt, plan, cli.given_flags(argv, tmp_path, task), said.append)
    assert perf.parse(opt.levers)['cuda_graphs'] is False and opt.device == 'cpu'
    assert [line for line in said if 'cuda_graphs 1 -> 0' in line]
    cli.check_options(opt, 1, task)  # what would refuse the resume: '--levers cuda_graphs=1 needs a CUDA device'


def test_cudnn_benchmark_off_leaves_the_choice_to_cudnns_heuristics_and_only_deterministic_restricts_it(
        monkeypatch):
    """Off, the switch leaves each convolution to cuDNN's heuristics (torch's default), not to the deterministic
    algorithms: those come with --deterministic alone."""
    monkeypatch.setenv('CUBLAS_WORKSPACE_CONFIG', perf.CUBLAS_WORKSPACE)  # the variables it may set, restored after
    monkeypatch.setenv('PYTHONHASHSEED', '0')
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
             torch.are_deterministic_algorithms_enabled())
    try:
        for switch, deterministic in ((False, False), (True, False), (False, True)):
            torch.use_deterministic_algorithms(False)
            torch.backends.cudnn.deterministic = False
            perf.apply_to_torch(replace(Perf(), cudnn_benchmark=switch), seed=0, deterministic=deterministic)
            assert torch.backends.cudnn.benchmark == switch
            assert torch.are_deterministic_algorithms_enabled() == torch.backends.cudnn.deterministic == deterministic
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[:2]
        torch.use_deterministic_algorithms(saved[2])


@pytest.mark.usefixtures('upstream_importable')
def test_autobatch_measures_with_cudnn_benchmark_off_and_turns_it_on_again(monkeypatch):
    """Upstream's autobatch() answers 16 without measuring while cudnn.benchmark is on, and it is the kit's
    default: unless it is off while AutoBatch measures, --batch-size -1 does nothing on a GPU."""
    from yolov9_ddp import build
    measured_with = []
    monkeypatch.setattr(build, 'check_train_batch_size',
                        lambda model, imgsz, amp: measured_with.append(torch.backends.cudnn.benchmark) or 48)
    monkeypatch.setattr(torch.backends.cudnn, 'benchmark', True)
    assert build.autobatch(torch.nn.Identity(), 640, True) == 48 and measured_with == [False]
    assert torch.backends.cudnn.benchmark, 'the switch is on again for training'


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
def test_cuda_graphs_accumulate_gradients_over_micro_steps_as_eager():
    """A .grad that took the replay's buffer over would add the next micro-step's gradient to itself, unless each
    gradient is cloned on its way or backward adds into a .grad that the optimizer zeroed in place
    (Trainer.zero_grad, under cuda_graphs): two optimizer steps of two micro-steps each, their gradients the eager
    ones; the clones go once the gradients are resident, and without the graphs the gradients are freed."""
    from yolov9_ddp.trainer import Trainer
    torch.manual_seed(0)
    model, batches = torch.nn.Linear(4, 3, bias=False), [torch.randn(5, 4) for _ in range(4)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0)

    def accumulated(forward, graphed: bool):
        trainer = SimpleNamespace(optimizer=optimizer, perf=Perf(cuda_graphs=graphed), forward=forward)
        model.weight.grad, sums = None, []
        for step in (0, 1):
            for batch in batches[2 * step:2 * step + 2]:
                forward(batch).square().sum().backward()
            sums.append(model.weight.grad.clone())
            Trainer.zero_grad(trainer)
        return sums
    eager = accumulated(model, graphed=False)
    assert model.weight.grad is None, 'without the graphs the gradients are freed'
    graphed = graphs.GraphedModel(model, capture=static_gradient_capture)
    assert list(graphed.clones) == [model.weight]
    assert all(map(torch.equal, accumulated(graphed, graphed=True), eager))
    assert graphed.clones == {} and torch.equal(model.weight.grad, torch.zeros(3, 4)), 'zeroed in place, no clone'


@pytest.mark.usefixtures('upstream_importable')
def test_out_of_gpu_memory_for_the_graphs_the_run_trains_on_without_them_after_one_line(monkeypatch):
    """A capture out of memory (graphs.capture_graphs, make_graphed_callables stood in for) leaves the BatchNorm
    statistics as they were and the step runs eagerly; a validation out of memory with graphs lets them go and runs
    again; without graphs, or once they have gone, the error is the run's."""
    from yolov9_ddp.trainer import Trainer
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    eager = copy.deepcopy(model)

    def out_of_memory(module, samples, **kwargs):
        module(*samples)  # a warm-up pass, which updates the statistics
        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')
    monkeypatch.setattr(torch.cuda, 'make_graphed_callables', out_of_memory)
    lines = []
    graphed = graphs.GraphedModel(model, log=lines.append)
    x = torch.randn(5, 4)
    assert torch.equal(graphed(x), eager(x)) and graphed.eager and graphed.clones == {}
    assert torch.equal(model[1].running_mean, eager[1].running_mean), 'updated by the step alone, not the warm-up'
    assert len(lines) == 1 and lines[0].startswith('WARNING: out of GPU memory capturing the graphs of a batch of '
                                                   '(5, 4): training goes on without CUDA graphs'), lines

    def validation(fails: int):
        calls = []

        def validated(model, plots, compute_loss=True):
            calls.append(model)
            if len(calls) <= fails:
                raise torch.OutOfMemoryError('CUDA out of memory')
            return 'metrics'
        return calls, validated

    def trainer(**attributes):
        made = Trainer.__new__(Trainer)
        vars(made).update(attributes)
        return made
    calls, validated = validation(1)
    with_graphs = trainer(perf=Perf(cuda_graphs=True), forward=graphs.GraphedModel(model, log=lines.append),
                          validated=validated)
    assert with_graphs.validate('ema', plots=False) == 'metrics' and calls == ['ema', 'ema']
    assert with_graphs.forward.eager and lines[-1].startswith('WARNING: out of GPU memory in validation: ')
    for perf, forward in ((Perf(cuda_graphs=True), with_graphs.forward), (Perf(), model)):
        calls, validated = validation(1)
        with pytest.raises(torch.OutOfMemoryError):
            trainer(perf=perf, forward=forward, validated=validated).validate('ema', plots=False)
    assert len(lines) == 2



@pytest.mark.usefixtures('upstream_importable')
def test_out_of_gpu_memory_in_a_training_step_the_graphs_go_and_the_micro_step_runs_again_eagerly():
    """Out of memory in a micro-step beside the graphs (here in its loss), where no other micro-step's gradients are
    held: the graphs go in one line and the micro-step runs again, to the gradients of one eager micro-step. Where
    another's are held, without graphs, or once they have gone, the error is the run's."""
    from yolov9_ddp.trainer import Trainer
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    eager, x = copy.deepcopy(model), torch.randn(5, 4)
    eager(x).square().sum().backward()
    failures, lines = [1], []

    def compute_loss(pred, targets):
        if failures and failures.pop():
            raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')
        return pred.square().sum(), torch.zeros(3)

    def trainer(perf, last_opt_step=-1):
        made = Trainer.__new__(Trainer)
        vars(made).update(perf=perf, world=1, amp=False, warmup_iters=-1, compute_loss=compute_loss,
                          opt=SimpleNamespace(multi_scale=False, quad=False),
                          state=SimpleNamespace(last_opt_step=last_opt_step, accumulate=4),
                          scaler=torch.amp.GradScaler('cpu', enabled=False),
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          forward=graphs.GraphedModel(model, capture=lambda module, sample: module.forward,
                                                      log=lines.append) if perf.cuda_graphs else model)
        return made
    stepped_down = trainer(Perf(cuda_graphs=True))
    assert torch.equal(stepped_down.train_step(0, 0, x, None), torch.zeros(3)) and stepped_down.forward.eager
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()))
    assert lines == ['WARNING: out of GPU memory in a training step: training goes on without CUDA graphs '
                     '(cuda_graphs=0), which need memory of their own']
    for refused in (trainer(Perf(cuda_graphs=True), last_opt_step=-2), trainer(Perf()), stepped_down):
        failures.append(1)
        with pytest.raises(torch.OutOfMemoryError):
            refused.train_step(0, 0, x, None)
    assert len(lines) == 1

# -- recorded with a real run, kept by its resume ---------------------------------------------------------------

RUN_LEVERS = 'cudnn_benchmark=0,dense_box_loss=1'  # the run trains with the box loss over every anchor
RECORDED = replace(Perf(), cudnn_benchmark=False, dense_box_loss=True).describe()


@pytest.fixture(scope='module')
def interrupted_with_levers(patched_tree, demo_data, tmp_path_factory):
    """A 2-process run started with --levers, killed at the start of its last epoch."""
    return faults.interrupted_run(patched_tree, demo_data, tmp_path_factory.mktemp('levers'),
                                  extra=('--levers', RUN_LEVERS))


def recorded_levers(run_dir) -> tuple:
    """The switches in the run's opt.yaml and in its last.pt."""
    saved = yaml.safe_load((run_dir / 'opt.yaml').read_text())['levers']
    return saved, checkpoints.load_checkpoint(run_dir / 'weights' / 'last.pt')['opt']['levers']


@pytest.mark.usefixtures('upstream_importable')
@pytest.mark.parametrize('given, expected, change', [
    ((), RECORDED, None),
    (('--levers', 'cudnn_benchmark=1', '--channels-last'),
     replace(Perf(), dense_box_loss=True, channels_last=True).describe(),
     'levers changed on resume: channels_last 0 -> 1, cudnn_benchmark 0 -> 1')])
@pytest.mark.slow
def test_a_resume_trains_with_the_runs_switches_unless_given_again(patched_tree, interrupted_with_levers, tmp_path,
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


@pytest.mark.usefixtures('upstream_importable')
def test_validation_runs_without_cudnn_autotuning_and_training_gets_it_back_whatever_validation_does():
    """Validation's rectangular batches have many shapes: it runs at cuDNN's default algorithms, as upstream's, and
    the training's autotuning is back afterwards, after an error too."""
    import torch
    from yolov9_ddp.trainer import Trainer
    seen = []

    def validate(**options):
        seen.append((torch.backends.cudnn.benchmark, options['model']))
        if options['model'] == 'failing':
            raise torch.OutOfMemoryError('out of memory')
        return 'metrics'
    task = SimpleNamespace(validate=validate, validation_options=lambda opt: {})
    trainer = SimpleNamespace(task=task, data_dict={}, batch_size=8, world=1, imgsz=64, amp=False,
                              opt=SimpleNamespace(single_cls=False), val_loader=None, save_dir=None, primary=True,
                              callbacks=None, compute_loss=None)
    before = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = True
        assert Trainer.validated(trainer, 'ema', plots=False) == 'metrics'
        assert torch.backends.cudnn.benchmark
        with pytest.raises(torch.OutOfMemoryError):
            Trainer.validated(trainer, 'failing', plots=False)
        assert torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = before
    assert seen == [(False, 'ema'), (False, 'failing')]
