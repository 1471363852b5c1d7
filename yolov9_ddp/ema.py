"""The EMA on every rank, kept identical with all_reduce. DDP keeps the parameters equal, but each rank's BatchNorm
statistics follow its own images (no per-forward broadcast): once an epoch, before validation and saving, they and
the EMA's floating-point state are averaged over the ranks (as YOLOX's all_reduce_norm)."""
import torch
import torch.nn as nn

from yolov9_ddp.comm import average_tensors_, is_distributed

NORM_LAYERS = (nn.modules.batchnorm._NormBase,)


def norm_statistics(model: nn.Module):
    """The floating-point running statistics of every normalisation layer."""
    for module in model.modules():
        if isinstance(module, NORM_LAYERS):
            for buffer in (module.running_mean, module.running_var):
                if buffer is not None:
                    yield buffer


def floating_state(model: nn.Module):
    """Every floating-point tensor of the state dict (parameters and buffers)."""
    return [t for t in model.state_dict().values() if t.dtype.is_floating_point]


def synchronize_ema(ema, model: nn.Module):
    """Average the model's normalisation statistics and the EMA's floating state over all ranks; one process has
    nothing to average, and skips the walk over every module."""
    if not is_distributed():
        return
    average_tensors_(norm_statistics(model))
    average_tensors_(floating_state(ema.ema))


class EmaUpdater:
    """ModelEMA.update() as multi-tensor kernels, with upstream's arithmetic bit for bit (v *= d, then
    v += (1 - d) * m; a lerp rounds otherwise), instead of three kernels per tensor. The tensor lists are rebuilt when
    a module's tensors were replaced, as validation's model.half() and .float() do: stale lists would freeze the EMA."""

    def __init__(self, ema, model: nn.Module):
        self.ema = ema
        self.track(model)

    def track(self, model: nn.Module):
        pairs = [(e, m) for e, m in zip(self.ema.ema.state_dict().values(), model.state_dict().values())
                 if e.dtype.is_floating_point]
        self.ema_tensors = [e for e, _ in pairs]
        self.model_tensors = [m.detach() for _, m in pairs]
        self.storage = first_storage(self.ema.ema), first_storage(model)

    def __call__(self, model: nn.Module):
        if (first_storage(self.ema.ema), first_storage(model)) != self.storage:
            self.track(model)
        self.ema.updates += 1
        decay = self.ema.decay(self.ema.updates)
        with torch.no_grad():
            torch._foreach_mul_(self.ema_tensors, decay)
            torch._foreach_add_(self.ema_tensors, torch._foreach_mul(self.model_tensors, 1 - decay))


def first_storage(module: nn.Module) -> int:
    """Where the first parameter's data lives, which a conversion such as .half() changes (the lists keep the old
    tensors alive, so no new one takes over their address)."""
    return next(module.parameters()).data_ptr()
