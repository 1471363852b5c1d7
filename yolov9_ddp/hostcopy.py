"""A copy of a checkpoint in host memory, made without the training thread waiting for the GPU.

The training thread pickles the checkpoint with every tensor set aside and queues each tensor's copy to the host on
the GPU's stream, behind the step that made it (no second copy on the GPU, as a deepcopy would make); result(), in
the writer, waits for them and rebuilds the checkpoint around them, off the training thread.
"""
import io
import itertools
import pickle
from collections import OrderedDict, defaultdict

import torch
from torch import nn

CHANNELS_LAST = (torch.channels_last, torch.channels_last_3d)


class QueuedHostCopy:
    """obj as detached copies in host memory, sharing nothing with it: made on the training thread between two steps,
    result() in the writer."""

    def __init__(self, obj):
        buffer = io.BytesIO()
        pickler = TensorsAside(buffer)
        pickler.dump(obj)
        self.pickled = buffer.getvalue()
        self.kinds = [(isinstance(t, nn.Parameter), t.requires_grad) for t in pickler.tensors]
        self.copies, self.landed = queue_host_copies(pickler.tensors)

    def result(self):
        """The copy, once: its page-locked buffers go back to torch's cache as it returns."""
        copies, self.copies = self.landed_copies(), None
        tensors = [own_tensor(copy, parameter, requires_grad)
                   for copy, (parameter, requires_grad) in zip(copies, self.kinds)]
        return TensorsBack(io.BytesIO(self.pickled), tensors).load()

    def landed_copies(self) -> list:
        """The host copies of the tensors set aside, once every queued copy has landed (views of shared buffers)."""
        if self.landed is not None:
            self.landed.synchronize()
            self.landed = None
        return self.copies

    def __getstate__(self):
        """What a writer process gets: all but the host copies, which follow as bytes, and the event."""
        return {**self.__dict__, 'copies': None, 'landed': None}


class TensorsAside(pickle.Pickler):
    """Pickles all but the tensors, which it sets aside in self.tensors, each once. A module's empty OrderedDicts
    pickle as OrderedDict(): pickle's own reduction asks copyreg, in Python, for their slot names, which is slow."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = []

    def reducer_override(self, obj):
        if type(obj) is OrderedDict and not obj:
            return OrderedDict, ()
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        self.tensors.append(obj)
        return set_aside, (len(self.tensors) - 1,)


def set_aside(index: int):
    """The stand-in that TensorsAside pickles for its index-th tensor, which TensorsBack puts back."""
    raise pickle.UnpicklingError('a checkpoint pickled with its tensors set aside is read back by TensorsBack only')


class TensorsBack(pickle.Unpickler):
    """Unpickles what TensorsAside pickled, with the given tensors in place of those it set aside."""

    def __init__(self, file, tensors: list):
        super().__init__(file)
        self.tensors = tensors

    def find_class(self, module, name):
        if (module, name) == (__name__, set_aside.__name__):
            return self.tensors.__getitem__
        return super().find_class(module, name)


def queue_host_copies(tensors: list) -> tuple:
    """(detached host copies of tensors, each in its memory format; the event behind those from a GPU, or None). The
    tensors of one device and dtype are copied by one call into views of one buffer (page-locked for a GPU's, so the
    copies are only queued), not thousands; a tensor that does not fill its memory densely is copied alone."""
    copies, groups = [None] * len(tensors), defaultdict(list)
    for i, tensor in enumerate(tensors):
        if dense(tensor):
            groups[tensor.device, tensor.dtype].append(i)
        else:
            copies[i] = tensor.detach().to('cpu', copy=True, non_blocking=True)
    for (device, dtype), indices in groups.items():
        sizes = [tensors[i].numel() for i in indices]
        buffer = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == 'cuda')
        for i, start in zip(indices, itertools.accumulate(sizes, initial=0)):
            copies[i] = buffer.as_strided(tensors[i].shape, tensors[i].stride(), start)
        with torch.no_grad():
            torch._foreach_copy_([copies[i] for i in indices], [tensors[i] for i in indices], non_blocking=True)
    gpus = {tensor.device for tensor in tensors if tensor.is_cuda}  # one: a rank's state lives on its GPU
    if not gpus:
        return copies, None
    landed = torch.cuda.Event()
    landed.record(torch.cuda.current_stream(gpus.pop()))
    return copies, landed


def dense(tensor: torch.Tensor) -> bool:
    """Whether tensor's elements fill its memory without gaps, in the order of one of torch's memory formats."""
    return tensor.layout == torch.strided and (tensor.is_contiguous() or any(
        tensor.is_contiguous(memory_format=memory_format) for memory_format in CHANNELS_LAST))


def own_tensor(copy: torch.Tensor, parameter: bool, requires_grad: bool) -> torch.Tensor:
    """A host copy in its own storage (torch.save writes a storage whole), in the same memory format; a Parameter
    stays one (a pickled module's are)."""
    copy = copy.clone()
    if parameter:
        return nn.Parameter(copy, requires_grad=requires_grad)
    return copy.requires_grad_(requires_grad)


def scaler_state(scaler) -> dict:
    """GradScaler.state_dict(), its scale and growth tracker left as copies on their device (state_dict() reads each
    with .item(), a wait for the GPU); the host copy takes them, and scaler_numbers() makes them numbers there."""
    scale = scaler._get_scale_async() if scaler.is_enabled() else None
    if scale is None:  # disabled, or before the first scaled step: state_dict() reads nothing from a device
        return scaler.state_dict()
    return {'scale': scale.detach().clone(), 'growth_factor': scaler.get_growth_factor(),
            'backoff_factor': scaler.get_backoff_factor(), 'growth_interval': scaler.get_growth_interval(),
            '_growth_tracker': scaler._growth_tracker.detach().clone()}


def scaler_numbers(state: dict) -> dict:
    """scaler_state()'s host copy as GradScaler.state_dict() gives it: numbers only (upstream's files hold those)."""
    return {key: value.item() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
