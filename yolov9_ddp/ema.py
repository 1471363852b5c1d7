"""EMA on every rank, kept identical with all_reduce.

Every rank runs upstream's ModelEMA: DDP keeps the parameters equal, so the parameter averages
stay equal too. BatchNorm running statistics are another matter: DDP is built with
broadcast_buffers=False, so each rank's statistics follow its own images. Once per epoch, before
validation and saving, the running statistics of the model and the whole floating-point state of
the EMA are averaged over the ranks (as YOLOX's all_reduce_norm): afterwards the statistics
reflect every rank's data and the EMA state is the same bits on every rank.
"""
import torch
import torch.nn as nn

from yolov9_ddp.comm import average_tensors_

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
    """Average the model's normalisation statistics and the EMA's floating state over all ranks."""
    average_tensors_(norm_statistics(model))
    average_tensors_(floating_state(ema.ema))


class EmaUpdater:
    """ModelEMA.update() as multi-tensor kernels, with upstream's arithmetic bit for bit: v *= d, then
    v += (1 - d) * m, each over all tensors at once (a lerp would be one kernel, but rounds otherwise, and
    --deterministic keeps upstream's numerics; the two extra passes over the EMA's 40 MB cost microseconds).

    Upstream's update walks the state dict and launches three kernels per tensor (about 4,400 launches an optimizer
    step for yolov9-s); here the tensor lists are built once and rebuilt only when a module's tensors were replaced.
    That happens after every validation on CUDA with AMP: val_dual's model.half() and model.float() give the
    EMA new tensors, and lists kept from before would leave the EMA frozen from then on.
    """

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
    """Where the first parameter's data lives: a conversion such as .half() replaces every tensor, this one too.

    The lists keep the replaced tensors alive, so a new tensor never takes over the old one's address."""
    return next(module.parameters()).data_ptr()
