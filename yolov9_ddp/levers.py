"""Performance levers of the training loop, measured on 2 x H200 by bench/ (bench/RESULTS.md).

The defaults below are the settings of the kit's measured runs: cudnn autotuning instead of upstream's
deterministic algorithms, the fused SGD, and the levers that only move data or launch fewer kernels.

A run's levers are one of its options: `--levers name=value,...` sets any of them, `--channels-last` is short for
`--levers channels_last=1`. The complete set a run trains with is written into its opt.yaml and checkpoints as
`levers`, so a resume trains with the levers the run started with; a resume that gives --levers (or
--channels-last) again changes the levers it names, and logs the change.

--deterministic trains with upstream's numerics (the levers of DETERMINISTIC off, whatever their defaults) and
deterministic algorithms only: the same seed and world size then give bit-identical weights. A --levers that turns
one of those levers on contradicts it and is refused.

cuda_graphs (yolov9_ddp/graphs.py) keeps the arithmetic bit for bit; with channels_last it is a default of a new
run on one GPU where measured (ONE_GPU_DEFAULTS), and refused on CPUs, with DDP, with shapes that change and with
--deterministic. A run that recorded it and resumes where it cannot apply goes on without it, saying so in one line.

A lever that does not pay is removed, not kept: torch.compile (--compile) is refused with the measurement that
removed it (REMOVED). Activations out of place (undoing upstream's inplace=True) were measured on one H200 and
removed: 0.98x in the GPU-only step, 1.03x end to end, both inside the spread of their pairs (bench/RESULTS.md).
So were graphed_loss (the detection loss captured with the model in its CUDA graphs, with patch 0019) and
one_cpu_thread (the training process's CPU work on one thread), on one H200 on 2026-12-06: 0.993x (0.991-1.058) and
1.042x (0.971-1.076) the one-GPU defaults end to end, each inside the spread of its pairs (bench/RESULTS.md); the runs
that recorded them resume without them (RETIRED).
"""
import os
from dataclasses import dataclass, fields, replace

import torch
import torch.utils.deterministic  # noqa: F401 (fill_uninitialized_memory, torch >= 2.2: imported, not assumed)


@dataclass(frozen=True)
class Levers:
    pin_memory: bool = True  # page-locked batches, copied to the GPU with non_blocking=True (no host sync)
    persistent_workers: bool = True  # workers live across epochs and load the next epoch's first batches before it
    prefetch_factor: int = 4  # batches each loader worker keeps ready
    fused_optimizer: bool = True  # one fused kernel per parameter group; with AMP also no found_inf .item() sync
    foreach_ema: bool = True  # EMA update as a few multi-tensor kernels instead of three kernels per tensor
    bucket_view: bool = True  # DDP gradient_as_bucket_view: gradients live in the all-reduce buckets (no copy)
    static_graph: bool = False  # DDP static_graph (see yolov9#559: breaks models with unused parameters)
    progress_every: int = 10  # steps between progress-bar updates (each a copy of the losses: progress.py)
    cudnn_benchmark: bool = True  # autotuned convolutions instead of upstream's deterministic algorithms
    channels_last: bool = False  # NHWC tensors for the convolutions (--channels-last)
    cuda_graphs: bool = False  # forward and backward replayed as CUDA graphs, one GPU (yolov9_ddp/graphs.py)
    fill_uninitialized: bool = False  # under deterministic algorithms, torch's NaN in every new tensor (a memset each)
    host_targets: bool = False  # detection losses get the loader's targets and pad them on the host (patch 0016)
    dense_box_loss: bool = False  # detection box losses over every anchor: no masked_select waits (boxloss.py)
    checkpoint_process: bool = False  # periodic checkpoints written by a child process (checkpoint_process.py)
    resident_grads: bool = False  # gradients zeroed in place between optimizer steps, not freed (graphs.py)


# The defaults of a new run on one CUDA process, measured there (bench/RESULTS.md, "One-GPU defaults": 2.1x
# upstream's train_dual.py end to end on one H200, 3 pairs; parity with upstream's numerics over 3 seeds, each
# seed's difference inside the spread between seeds): channels-last makes the GPU's step faster, and CUDA graphs let
# the loop reach it; every entry point trains with them on one H200 (bench/RESULTS.md, 2026-12-05). Not on more
# processes (not measured there) or on CPUs; cuda_graphs only where yolov9_ddp/graphs.py can use it. --levers and
# --deterministic win over them. For the detection tasks the two loss levers joined them, measured on an H100
# (bench/RESULTS.md, 2026-12-05, sixth and seventh sessions): both together trained 1.083x the defaults end to end
# and dense_box_loss on top of host_targets 1.065x (3 pairs each); dense_box_loss kept parity over 3 seeds (its sums
# run in another order). host_targets alone did not pay (the defaults without it: 1.008x), as it leaves the box
# loss's 10 waits a step, so --deterministic, which turns dense_box_loss off, leaves it off (graphs.py).
# On an H100 (bench/RESULTS.md, 2026-12-06, eleventh session) resident_grads trained 1.111x the defaults end to end
# (3 pairs, 1.072 to 1.119; the same numbers: test_levers), so it joined them where cuda_graphs does (its clones are
# the graphs'); and in one run whose periodic checkpoints the writer's thread and checkpoint_process wrote in turn,
# each of the process's lost less training than the thread's beside it (0.05-0.25 s against 0.35-0.89 s), so it
# joined them too (it acts where periodic checkpoints are asked for).
ONE_GPU_DEFAULTS = {'cuda_graphs': True, 'channels_last': True, 'host_targets': True, 'dense_box_loss': True,
                    'resident_grads': True, 'checkpoint_process': True}

# the levers that change the arithmetic or let it vary from run to run: --deterministic turns them off
# (foreach_ema is not one of them: its kernels do upstream's arithmetic, bit for bit, yolov9_ddp/ema.py)
DETERMINISTIC = {'cudnn_benchmark': False, 'fused_optimizer': False, 'channels_last': False, 'dense_box_loss': False}
LOSS_LEVERS = ('host_targets', 'dense_box_loss')  # what the detection losses take (tasks.Detection.takes_loss_levers)
CUBLAS_WORKSPACE = ':4096:8'  # what cuBLAS needs for deterministic results (upstream's init_seeds sets it too)


REMOVED = {'compile': 'torch.compile does not pay for YOLOv9 training: yolov9-s had not finished compiling its first '
                      'epoch after 5 minutes on an H200, and on a CPU its first epoch took 623 s instead of 13 s and '
                      'the next ones longer than without it (bench/RESULTS.md); train without it'}
# Levers removed after runs recorded them: a run records its complete set (describe), so the runs of earlier kits hold
# these, mostly off (=0, their default then). A resume drops an off one without a word, as it changed nothing there;
# one that was on is warned about, as any lever this kit does not have.
RETIRED = ('act_out_of_place', 'graphed_loss', 'one_cpu_thread')


def parse_levers(text: str, known_only=True, warn=print) -> dict:
    """'name=value,...' -> {name: typed value}; a bad value raises ValueError, and so does an unknown name unless
    known_only is False (the levers a run recorded under another kit version: unknown ones are warned about, but
    for a RETIRED one that was off)."""
    known = {f.name: f.type for f in fields(Levers)}
    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(','))):
        name, _, value = item.partition('=')
        if name in REMOVED and known_only:
            raise ValueError(f'--levers {name}: {REMOVED[name]}')
        if name not in known:
            if known_only:
                raise ValueError(f'--levers: unknown lever {name!r} (known: {", ".join(known)})')
            if not retired_off(name, value):
                warn(f'the run recorded the lever {name!r}, which this kit does not have: ignored')
            continue
        if known[name] in (bool, 'bool'):
            if value not in ('0', '1'):
                raise ValueError(f'--levers: {name} takes 0 or 1, not {value!r}')
            overrides[name] = value == '1'
        else:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f'--levers: {name} takes a whole number >= 1, not {value!r}')
            overrides[name] = int(value)
    return overrides


def retired_off(name: str, value: str) -> bool:
    """Whether a recorded lever is a RETIRED one that was off, which its resume can drop silently."""
    return name in RETIRED and value == '0'


def requested_levers(options, known_only=True, warn=print) -> dict:
    """The levers a set of options asks for (the command line's, or a run's recorded ones): --channels-last, then
    --levers, which wins; with --deterministic, those of DETERMINISTIC off (a request to turn one on is refused)."""
    options = options if isinstance(options, dict) else vars(options)
    if options.get('compile') and known_only:
        raise ValueError(f'--compile: {REMOVED["compile"]}')
    flags = {'channels_last': True} if options.get('channels_last') else {}
    asked = parse_levers(options.get('levers') or '', known_only, warn)
    if not options.get('deterministic'):
        return {**flags, **asked}
    for name, value in {**flags, **asked}.items():
        if name in DETERMINISTIC and value != DETERMINISTIC[name]:
            given = '--channels-last' if name not in asked else f'--levers {name}={int(value)}'
            raise ValueError(f'--deterministic trains with upstream\'s numerics, {name}=0; {given} contradicts it: '
                             f'give one of the two')
    return {**flags, **asked, **DETERMINISTIC}


def levers_for(opt, defaults: dict = None) -> Levers:
    """The levers opt asks for, over Levers' defaults and the given ones (a new run's ONE_GPU_DEFAULTS)."""
    return replace(Levers(), **{**(defaults or {}), **requested_levers(opt)})


def describe(levers: Levers) -> str:
    """Every lever as 'name=value,...' (what --levers takes): a run records the complete set it trains with."""
    return ','.join(f'{f.name}={int(getattr(levers, f.name))}' for f in fields(Levers))


def record_levers(opt, defaults: dict = None) -> Levers:
    """The run's levers, written into opt as their complete description (so into opt.yaml and the checkpoints)."""
    levers = levers_for(opt, defaults)
    opt.levers = describe(levers)
    return levers


def resumed_levers(recorded_options: dict, given: dict, log=print) -> str:
    """The levers of a resumed run: the ones it recorded, changed where this launch's flags (given) name others."""
    recorded = replace(Levers(), **requested_levers(recorded_options, known_only=False, warn=log))
    resumed = replace(recorded, **given)
    changes = [f'{f.name} {int(getattr(recorded, f.name))} -> {int(getattr(resumed, f.name))}'
               for f in fields(Levers) if getattr(recorded, f.name) != getattr(resumed, f.name)]
    if changes:
        log(f'levers changed on resume: {", ".join(changes)}')
    return describe(resumed)


def use_deterministic_algorithms(seed: int, fill_uninitialized: bool):
    """Upstream's init_seeds(deterministic=True), keeping a CUBLAS_WORKSPACE_CONFIG the user set (entry.py sets it
    for --deterministic before CUDA starts), and without torch's fill of uninitialised memory unless the lever
    asks for it: torch then writes NaN into every tensor it allocates (thousands a step, one memset each) so that a
    program that reads memory it never wrote is deterministic too; training reads none, so the fill changes no bit
    (tests/test_levers.py: two --deterministic runs, one with it, end bit-identical), and torch's documentation
    says to turn it off for speed in that case: 1.19x a --deterministic run end to end on an H200 (bench/RESULTS.md)."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized
    torch.backends.cudnn.deterministic = True
    os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', CUBLAS_WORKSPACE)
    os.environ['PYTHONHASHSEED'] = str(seed)


def fused_optimizer(optimizer):
    """The same optimizer with fused kernels: one launch per parameter group, and no found_inf sync in GradScaler.

    torch's fused SGD allocates its momentum buffers uninitialised (torch.empty_like) and fills them in its first
    step. Under AMP that first step is often skipped (gradient overflow at the initial scale), and the buffers
    then stay garbage: the next step writes NaN into the weights. Zero buffers, created here, make the first
    real step exactly the step of the unfused optimizer (buffer = momentum * 0 + gradient).
    """
    implementation = ('foreach', 'fused', 'differentiable')
    groups = [{k: v for k, v in group.items() if k not in implementation} for group in optimizer.param_groups]
    defaults = {k: v for k, v in optimizer.defaults.items() if k not in implementation}
    fused = type(optimizer)(groups, **defaults, fused=True)
    if isinstance(fused, torch.optim.SGD):
        for group in fused.param_groups:
            if group['momentum']:
                for p in group['params']:
                    fused.state[p]['momentum_buffer'] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return fused
