"""The lever cuda_graphs: the model's forward and backward replayed as CUDA graphs (torch.cuda.make_graphed_callables),
the loss, the optimizer step and the EMA left eager. On one H200 the training thread issues the step's kernels more
slowly than the GPU runs them (bench/RESULTS.md, "Where the loop's time goes"); a replay issues them all at once.

    forward = GraphedModel(model)      # in Trainer, one process on a GPU; forward(imgs) instead of model(imgs)

One capture per input shape: a run's batches share one, its last batch may have another (--multi-scale and --rect,
whose shapes change every step, are refused). A capture runs the model forward and backward a few times on the
batch it is given; BatchNorm's running statistics are put back afterwards, so the run's arithmetic stays its own.
"""
from contextlib import contextmanager
from dataclasses import replace

import torch

from yolov9_ddp.levers import ONE_GPU_DEFAULTS, Levers, describe, parse_levers


def no_cuda(opt) -> bool:
    return opt.device == 'cpu' or not torch.cuda.is_available()


def unsupported(opt, world_size: int) -> str:
    """Why this run cannot train with cuda_graphs=1 ('' where it can)."""
    if no_cuda(opt):
        return 'needs a CUDA device'
    if world_size > 1:
        return 'is measured on one GPU only (bench/RESULTS.md): train on one process, or without it'
    if opt.multi_scale or opt.rect:
        return 'needs one input shape for the run: not with --multi-scale or --rect'
    if opt.deterministic:  # 1 capture of 5 failed there on an H200 (bench/RESULTS.md, calls 7 and 8), for a 5% gain
        return ('is not offered with --deterministic: its capture failed there in cuDNN '
                '(CUDNN_STATUS_INTERNAL_ERROR, bench/RESULTS.md)')
    return ''


def no_graphs_by_default(opt, world_size: int) -> str:
    """Why a new run here does not take cuda_graphs as a default ('' where it does): where it cannot use them, and
    where the batch is AutoBatch's (--batch-size -1): AutoBatch sizes the batch to a share of the GPU's memory by the
    eager step's, and the captured graphs keep their own memory beside the cache (2.4 GB more at batch 32 on an
    H200, bench/RESULTS.md), which its estimate does not hold."""
    autobatch = 'is left out under AutoBatch (--batch-size -1)' if opt.batch_size == -1 else ''
    return unsupported(opt, world_size) or autobatch


def one_gpu_defaults(opt, world_size: int, task) -> dict:
    """The levers.ONE_GPU_DEFAULTS a new run takes here: none on CPUs, on more processes or on resume (a run keeps
    its own); the loss levers only where the task's loss takes them, and host_targets, which alone did not pay, not
    under --deterministic, which turns dense_box_loss off; cuda_graphs only where no_graphs_by_default finds no
    reason against it, and resident_grads with it (measured there: it takes out the graphs' clones)."""
    if opt.resume or world_size > 1 or no_cuda(opt):
        return {}
    no_graphs = no_graphs_by_default(opt, world_size)
    left_out = {'cuda_graphs': no_graphs, 'resident_grads': no_graphs,
                'host_targets': not task.takes_loss_levers or opt.deterministic,
                'dense_box_loss': not task.takes_loss_levers}
    return {name: value for name, value in ONE_GPU_DEFAULTS.items() if not left_out.get(name)}


def off_where_unsupported(opt, world_size: int, given: dict, log=print) -> str:
    """The levers of a resumed start (opt.levers, the run's own): a recorded cuda_graphs=1 turned off, in one line,
    where this start cannot use it (on more processes, on CPUs, with --deterministic given now), so that the run
    goes on there (issue 21: a run continues on another number of processes). Given on this command line (given,
    levers.requested_levers), it is refused instead, by cli.check_options."""
    levers = Levers(**parse_levers(opt.levers))
    reason = levers.cuda_graphs and 'cuda_graphs' not in given and unsupported(opt, world_size)
    if not reason:
        return opt.levers
    log(f'levers changed on resume: cuda_graphs 1 -> 0, as this start cannot use it (cuda_graphs=1 {reason}); '
        'a resume on one GPU turns it on again with --levers cuda_graphs=1')
    return describe(replace(levers, cuda_graphs=False))


class GraphedModel:
    """model(imgs) in training mode through the graph captured for imgs' shape and layout, captured on first use.

    The replay hands out its own gradient buffers, and a .grad that took one over would add the next micro-step's
    gradient to itself (pytorch/pytorch#181723, open: make_graphed_callables' static gradient buffers and
    accumulation). So each parameter's gradient is cloned on its way to .grad: a Python hook and a kernel per
    parameter and micro-step (897 for yolov9-s). With the lever resident_grads the optimizer zeroes the gradients in
    place instead of freeing them (Trainer.zero_grad), backward adds into a .grad that exists, and resident() takes
    the clone off every parameter that has one."""

    def __init__(self, model: torch.nn.Module, capture=None):
        self.model, self.graphed, self.capture = model, {}, capture or capture_graphs  # tests capture without CUDA
        self.clones = {parameter: parameter.register_hook(torch.clone)
                       for parameter in model.parameters() if parameter.requires_grad}

    def resident(self):
        """The gradients were zeroed in place: backward adds into each .grad there is, and needs no clone there (a
        parameter without one, unused so far, keeps its clone)."""
        for parameter in [parameter for parameter in self.clones if parameter.grad is not None]:
            self.clones.pop(parameter).remove()

    def __call__(self, imgs: torch.Tensor):
        key = (tuple(imgs.shape), imgs.dtype, imgs.is_contiguous(memory_format=torch.channels_last))
        if key not in self.graphed:
            self.graphed[key] = self.capture(self.model, imgs)
        return self.graphed[key](imgs)


def capture_graphs(model: torch.nn.Module, sample: torch.Tensor):
    """The graphed forward of model for inputs like sample. Call under autocast(cache_enabled=False) where the
    training step autocasts: the graph records the casts of the context it is captured in."""
    statistics = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with captures_checking_this_thread():
        torch.cuda.make_graphed_callables(model, (sample.clone(),), allow_unused_input=True)
    graphed = model.forward  # make_graphed_callables sets the module's forward to the graphed one: kept here ...
    del model.forward  # ... and the module's own restored, so that copies, checkpoints and eval mode stay plain
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(statistics[name])  # the warm-up passes updated them
    return graphed


class ThisThreadsCapture(torch.cuda.graph):
    """torch.cuda.graph in capture_error_mode 'thread_local', whatever mode it is given."""

    def __init__(self, cuda_graph, *args, **kwargs):
        super().__init__(cuda_graph, *args, **{**kwargs, 'capture_error_mode': 'thread_local'})


@contextmanager
def captures_checking_this_thread():
    """make_graphed_callables' captures check this thread's CUDA calls only. In torch's default mode, 'global', a
    potentially unsafe CUDA call of any other thread during a capture invalidates it, and the loader's pin-memory
    thread makes CUDA calls (page-locked allocations, queries of the events of blocks it reuses) while the training
    thread captures at its first step; the capture's next cuDNN call then fails. That may be what failed one capture
    on an H200 (bench/RESULTS.md, calls 7 and 8: CUDNN_STATUS_INTERNAL_ERROR, then 'operation failed due to a
    previous error during capture'; bench/gpu_checks.sh tries both modes). Those threads never touch the captured
    stream. make_graphed_callables takes the mode itself from torch 2.14 on (pytorch/pytorch#188832); it creates its
    captures through torch.cuda.graph in every version the kit runs on, so that is what is swapped for the time of
    the call (the training thread alone captures)."""
    global_mode = torch.cuda.graph
    torch.cuda.graph = ThisThreadsCapture
    try:
        yield
    finally:
        torch.cuda.graph = global_mode
