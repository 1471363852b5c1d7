"""The switch cuda_graphs: the model's forward and backward replayed as CUDA graphs (make_graphed_callables), the
loss, the optimizer step and the EMA eager. On a fast GPU the training thread issues a step's kernels more slowly
than the GPU runs them; a replay issues them at once. One capture per input shape (a run's batches share one, its
last batch may have another); BatchNorm's statistics, which the capture's passes update, are put back after it.
"""
from contextlib import contextmanager

import torch


class GraphedModel:
    """model(imgs) in training mode through the graph captured for imgs' shape and layout, on first use.

    The replay hands out its own gradient buffers, and a .grad that took one over would add the next micro-step's
    gradient to itself (pytorch/pytorch#181723): a gradient is cloned on its way to .grad until the trainer zeroes
    the gradients in place (Trainer.zero_grad), backward then adds into them, and resident() drops the clones."""

    def __init__(self, model: torch.nn.Module, capture=None, log=print):
        self.model, self.graphed, self.capture = model, {}, capture or capture_graphs  # tests capture without CUDA
        self.log, self.eager = log, False
        self.clones = {parameter: parameter.register_hook(torch.clone)
                       for parameter in model.parameters() if parameter.requires_grad}

    def resident(self):
        """The gradients were zeroed in place: backward adds into each .grad there is, and needs no clone there (a
        parameter without one, unused so far, keeps its clone)."""
        for parameter in [parameter for parameter in self.clones if parameter.grad is not None]:
            self.clones.pop(parameter).remove()

    def __call__(self, imgs: torch.Tensor):
        if self.eager:
            return self.model(imgs)
        key = (tuple(imgs.shape), imgs.dtype, imgs.is_contiguous(memory_format=torch.channels_last))
        if key not in self.graphed:
            try:
                self.graphed[key] = self.capture(self.model, imgs)
            except torch.OutOfMemoryError:
                pass  # stepped down below, once the error and the tensors its frames hold are gone
            if key not in self.graphed:
                self.step_down(f'capturing the graphs of a batch of {tuple(imgs.shape)}')
                return self.model(imgs)
        return self.graphed[key](imgs)

    def step_down(self, where: str):
        """Out of GPU memory: the graphs and their memory pools go, and the run trains on without them, as with
        cuda_graphs=0, after one line."""
        self.eager, self.graphed = True, {}
        for hook in self.clones.values():
            hook.remove()
        self.clones = {}
        torch.cuda.empty_cache()
        self.log(f'WARNING: out of GPU memory {where}: training goes on without CUDA graphs (cuda_graphs=0), which '
                 f'need memory of their own')


def capture_graphs(model: torch.nn.Module, sample: torch.Tensor):
    """The graphed forward of model for inputs like sample. Call under autocast(cache_enabled=False) where the
    training step autocasts: the graph records the casts of the context it is captured in."""
    statistics = {name: buffer.clone() for name, buffer in model.named_buffers()}
    try:
        with captures_checking_this_thread():
            torch.cuda.make_graphed_callables(model, (sample.clone(),), allow_unused_input=True)
        return model.forward  # make_graphed_callables sets the module's forward to the graphed one: kept here ...
    finally:
        model.__dict__.pop('forward', None)  # ... and the module's own restored: copies, checkpoints, eval mode
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(statistics[name])  # the warm-up passes updated them
        torch.cuda.empty_cache()  # the warm-up's memory, cached for its side stream, which nothing else uses


class ThisThreadsCapture(torch.cuda.graph):
    """torch.cuda.graph in capture_error_mode 'thread_local', whatever mode it is given."""

    def __init__(self, cuda_graph, *args, **kwargs):
        super().__init__(cuda_graph, *args, **{**kwargs, 'capture_error_mode': 'thread_local'})


@contextmanager
def captures_checking_this_thread():
    """make_graphed_callables' captures check this thread's CUDA calls only: in the default mode, 'global', the
    loader's pin-memory thread (page-locked allocations) invalidates the training thread's capture, whose next cuDNN
    call fails (CUDNN_STATUS_INTERNAL_ERROR). torch.cuda.graph, through which every version the kit runs on
    captures, is swapped for the call (pytorch/pytorch#188832 gives the mode from torch 2.14 on)."""
    global_mode = torch.cuda.graph
    torch.cuda.graph = ThisThreadsCapture
    try:
        yield
    finally:
        torch.cuda.graph = global_mode
