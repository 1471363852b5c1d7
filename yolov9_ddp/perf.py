"""The performance choices of a run, resolved once, from the device, the world size, the task, the input shapes
and --deterministic, into a frozen Perf that the rest of the kit only reads.

A user can set five switches, `--levers name=0|1,...` (`--channels-last` is short for `channels_last=1`):

    cuda_graphs       the model's forward and backward replayed as CUDA graphs, gradients zeroed in place
    channels_last     NHWC tensors for the convolutions
    cudnn_benchmark   training's convolutions autotuned at their first use instead of chosen by cuDNN's heuristics
    fused_optimizer   one fused kernel per parameter group for the optimizer step (CUDA)
    dense_box_loss    detection losses: targets padded on the host, the box loss over every anchor (boxloss.py)

A new run on one GPU takes ONE_GPU_DEFAULTS where they apply (their figures: docs/benchmarks.md); --deterministic
turns off what changes the arithmetic (DETERMINISTIC). A run records its set in opt.yaml and its checkpoints, and a
resume keeps it but for what its command line names, and for cuda_graphs where it cannot use them.
"""
import os
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.utils.deterministic  # noqa: F401 (fill_uninitialized_memory: imported, not assumed)


@dataclass(frozen=True)
class Perf:
    cuda_graphs: bool = False
    channels_last: bool = False
    cudnn_benchmark: bool = True
    fused_optimizer: bool = True
    dense_box_loss: bool = False

    def describe(self) -> str:
        """Every switch as 'name=value,...', what --levers takes: a run records the complete set it trains with."""
        return ','.join(f'{name}={int(value)}' for name, value in asdict(self).items())


SWITCHES = tuple(f.name for f in fields(Perf))
# cudnn_benchmark off: on one GPU, autotuning made a run's first step seconds slower and no epoch faster
ONE_GPU_DEFAULTS = {'cuda_graphs': True, 'channels_last': True, 'dense_box_loss': True, 'cudnn_benchmark': False}
DETERMINISTIC = {'cudnn_benchmark': False, 'fused_optimizer': False, 'channels_last': False, 'dense_box_loss': False}
CUBLAS_WORKSPACE = ':4096:8'  # what cuBLAS needs for deterministic results (upstream's init_seeds sets it too)
# The levers of kit 0.6.0 that are now always on, part of a switch (host_targets of dense_box_loss, resident_grads
# of cuda_graphs) or gone: a resume of such a run drops them without a word.
FORMER = ('pin_memory', 'persistent_workers', 'prefetch_factor', 'bucket_view', 'foreach_ema', 'progress_every',
          'static_graph', 'fill_uninitialized', 'host_targets', 'resident_grads', 'checkpoint_process')
COMPILE_REFUSED = ('torch.compile does not pay for YOLOv9 training: its first epoch compiles for minutes and the '
                   'next ones are no faster (docs/benchmarks.md); train without it')


def parse(text: str, strict=True, warn=print) -> dict:
    """'name=0|1,...' -> {name: bool}. strict: a name this kit does not have raises ValueError; otherwise (the
    levers a run recorded) a FORMER one is dropped and another is dropped with one line."""
    chosen = {}
    for item in filter(None, (part.strip() for part in (text or '').split(','))):
        name, _, value = item.partition('=')
        if name == 'compile' and strict:
            raise ValueError(f'--levers compile: {COMPILE_REFUSED}')
        if name not in SWITCHES:
            if strict:
                raise ValueError(f'--levers: unknown lever {name!r} (known: {", ".join(SWITCHES)})')
            if name not in FORMER:
                warn(f'the run recorded the lever {name!r}, which this kit does not have: ignored')
            continue
        if value not in ('0', '1'):
            raise ValueError(f'--levers: {name} takes 0 or 1, not {value!r}')
        chosen[name] = value == '1'
    return chosen


def requested(options, strict=True, warn=print) -> dict:
    """The switches a set of options asks for (the command line's, or a run's recorded ones): --channels-last, then
    --levers, which wins; with --deterministic, DETERMINISTIC's (a request to turn one of them on is refused)."""
    options = options if isinstance(options, dict) else vars(options)
    if options.get('compile') and strict:
        raise ValueError(f'--compile: {COMPILE_REFUSED}')
    flags = {'channels_last': True} if options.get('channels_last') else {}
    asked = parse(options.get('levers'), strict, warn)
    if not options.get('deterministic'):
        return {**flags, **asked}
    for name, value in {**flags, **asked}.items():
        if name in DETERMINISTIC and value != DETERMINISTIC[name]:
            given = '--channels-last' if name not in asked else f'--levers {name}={int(value)}'
            raise ValueError(f'--deterministic trains with upstream\'s numerics, {name}=0; {given} contradicts it: '
                             f'give one of the two')
    return {**flags, **asked, **DETERMINISTIC}


def no_cuda(opt) -> bool:
    return opt.device == 'cpu' or not torch.cuda.is_available()


def graphs_unsupported(opt, world_size: int) -> str:
    """Why this run cannot train with cuda_graphs=1 ('' where it can)."""
    if no_cuda(opt):
        return 'needs a CUDA device'
    if world_size > 1:
        return 'is measured on one GPU only (docs/benchmarks.md): train on one process, or without it'
    if opt.multi_scale or opt.rect:
        return 'needs one input shape for the run: not with --multi-scale or --rect'
    if opt.deterministic:  # a capture failed there in cuDNN on an H200, for a gain of 5%
        return 'is not offered with --deterministic: its capture failed there in cuDNN (CUDNN_STATUS_INTERNAL_ERROR)'
    return ''


def one_gpu_defaults(opt, world_size: int, task) -> dict:
    """The ONE_GPU_DEFAULTS a new run takes here: none on CPUs, on more processes or on resume (a run keeps its own);
    dense_box_loss where the task's loss takes it; cuda_graphs where they work and the batch is not AutoBatch's,
    which sizes it by the eager step's memory, without the graphs' own pools."""
    if opt.resume or world_size > 1 or no_cuda(opt):
        return {}
    left_out = {'cuda_graphs': graphs_unsupported(opt, world_size) or opt.batch_size == -1,
                'dense_box_loss': not task.takes_dense_box_loss}
    return {name: value for name, value in ONE_GPU_DEFAULTS.items() if not left_out.get(name)}


def checked(opt, world_size: int, task) -> Perf:
    """The switches the options ask for, refused in one line (ValueError) where they cannot act: cuda_graphs where
    they cannot work, dense_box_loss for a loss without box loss to weigh (a new run's; a resumed run goes on as it
    started)."""
    perf = replace(Perf(), **requested(opt))
    reason = perf.cuda_graphs and graphs_unsupported(opt, world_size)
    if reason:
        raise ValueError(f'--levers cuda_graphs=1 {reason}')
    if perf.dense_box_loss and not task.takes_dense_box_loss and not opt.resume:
        raise ValueError(f'--levers dense_box_loss=1 is for the detection losses; {task.script} trains with '
                         f'upstream\'s segmentation loss, which has no use for it')
    return perf


def for_run(opt, world_size: int, task) -> Perf:
    """The run's switches (a new run's defaults here, then what it asks for), recorded into opt: opt.yaml and the
    checkpoints keep the complete set."""
    perf = replace(Perf(), **{**one_gpu_defaults(opt, world_size, task), **requested(opt)})
    opt.levers = perf.describe()
    return perf


def resumed(recorded_options: dict, given: dict, opt, world_size: int, log=print) -> str:
    """The switches of a resumed start: the run's recorded ones, changed where this start's command line names
    others (given: requested() of it), and cuda_graphs off, in one line, where this start cannot use them."""
    recorded = replace(Perf(), **requested(recorded_options, strict=False, warn=log))
    perf = replace(recorded, **given)
    changes = [f'{name} {int(getattr(recorded, name))} -> {int(getattr(perf, name))}'
               for name in SWITCHES if getattr(recorded, name) != getattr(perf, name)]
    if changes:
        log(f'levers changed on resume: {", ".join(changes)}')
    reason = perf.cuda_graphs and 'cuda_graphs' not in given and graphs_unsupported(opt, world_size)
    if reason:
        log(f'levers changed on resume: cuda_graphs 1 -> 0, as this start cannot use them (cuda_graphs=1 {reason}); '
            'a resume on one GPU turns them on again with --levers cuda_graphs=1')
        perf = replace(perf, cuda_graphs=False)
    return perf.describe()


def apply_to_torch(perf: Perf, seed: int, deterministic: bool) -> str:
    """Set torch's global choices for the run; returns the line that says so under --deterministic ('' else).
    Deterministic algorithms as upstream's init_seeds(deterministic=True), but without torch's fill of new tensors
    with NaN: training reads no memory it did not write, and the fill costs a memset per tensor."""
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.deterministic = True
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', CUBLAS_WORKSPACE)
        os.environ['PYTHONHASHSEED'] = str(seed)
    torch.backends.cudnn.benchmark = perf.cudnn_benchmark
    if not deterministic:
        return ''
    return (f'--deterministic: levers {", ".join(f"{k}={int(v)}" for k, v in DETERMINISTIC.items())}, '
            f'torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG='
            f'{os.environ["CUBLAS_WORKSPACE_CONFIG"]}')


def fused(optimizer):
    """The same optimizer with fused kernels (one launch per parameter group, no found_inf sync in GradScaler), its
    SGD momentum buffers zeroed: torch's are left uninitialised when AMP skips the first step, and the next writes
    NaN into the weights."""
    implementation = ('foreach', 'fused', 'differentiable')
    groups = [{k: v for k, v in group.items() if k not in implementation} for group in optimizer.param_groups]
    defaults = {k: v for k, v in optimizer.defaults.items() if k not in implementation}
    fused_optimizer = type(optimizer)(groups, **defaults, fused=True)
    if isinstance(fused_optimizer, torch.optim.SGD):
        for group in fused_optimizer.param_groups:
            if group['momentum']:
                for p in group['params']:
                    fused_optimizer.state[p]['momentum_buffer'] = torch.zeros_like(
                        p, memory_format=torch.preserve_format)
    return fused_optimizer
