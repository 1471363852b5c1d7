"""The mean losses the training loop's progress bar shows, brought from the GPU without waiting for it."""
import torch

from yolov9_ddp.hostcopy import queue_host_copies

PROGRESS_EVERY = 10  # steps between two updates of the progress bar


class LaggingLosses:
    """Each update of the progress bar sends the mean losses on their way to the host and shows those the update
    before sent, arrived long since: a GPU value read the moment it is computed makes the host wait for the GPU's
    queue, and the GPU then idles. The epoch's last update shows its own. One per epoch."""

    def __init__(self):
        self.sent = None  # the copy the last update sent, and the event behind it on a GPU

    def shown(self, mloss: torch.Tensor, last: bool):
        """The losses to show at this update, or None (an epoch's first update: none sent before it)."""
        earlier, self.sent = self.sent, None if last else send_to_host(mloss)
        if last:
            return mloss.tolist()
        if earlier is None:
            return None
        copy, arrived = earlier
        if arrived is not None:
            arrived.synchronize()
        return copy.tolist()


def send_to_host(tensor: torch.Tensor) -> tuple:
    """(a host copy of tensor, the event it has arrived at or None): on a GPU the copy is on its way, into
    page-locked memory behind the work queued so far, as a checkpoint's copies are; elsewhere it is made at once."""
    [copy], arrived = queue_host_copies([tensor])
    return copy, arrived
