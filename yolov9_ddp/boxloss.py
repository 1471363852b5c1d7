"""The switch dense_box_loss: upstream's detection box loss (BboxLoss of utils/loss_tal*.py) over every anchor, the
background's terms weighted by zero, instead of over the foreground anchors that torch.masked_select picks out.

masked_select's size is read by the host before it can allocate: a wait for the GPU, five a box loss. With patches
0016 and 0017 (the targets padded on the host, Trainer.loss_targets) they are the detection loss's only waits. Over
every anchor the sums run in another order, so the last bits differ from upstream's: --deterministic turns it off.
"""
import types

import torch


def weigh_every_anchor(compute_loss):
    """upstream's ComputeLoss with each of its box losses (bbox_loss, bbox_loss2, ...) computed by dense_forward."""
    for module in vars(compute_loss).values():
        if type(module).__name__ == 'BboxLoss':
            module.forward = types.MethodType(dense_forward, module)
    return compute_loss


def dense_forward(self, pred_dist, pred_bboxes, anchor_points, target_bboxes, target_scores, target_scores_sum,
                  fg_mask):
    """BboxLoss.forward's IoU and DFL losses summed over every anchor, each weighted by its target score where it
    is foreground and by zero elsewhere; returns them and every anchor's IoU (a background anchor's is its stand-ins',
    background_stand_ins; upstream returns the foreground's, and no caller reads either)."""
    from utils.metrics import bbox_iou
    from utils.tal.anchor_generator import bbox2dist
    foreground = fg_mask.unsqueeze(-1)  # (b, h*w, 1)
    weight = torch.where(foreground, target_scores.sum(-1, keepdim=True), 0)
    pred_bboxes, target_bboxes = background_stand_ins(foreground, pred_bboxes, target_bboxes)
    iou = bbox_iou(pred_bboxes, target_bboxes, xywh=False, CIoU=True)  # (b, h*w, 1)
    loss_iou = ((1.0 - iou) * weight).sum() / target_scores_sum
    if not self.use_dfl:
        return loss_iou, torch.zeros((), device=pred_dist.device), iou
    target_ltrb = bbox2dist(anchor_points, target_bboxes, self.reg_max).reshape(-1, 4)
    loss_dfl = self._df_loss(pred_dist.reshape(-1, 4, self.reg_max + 1), target_ltrb) * weight.reshape(-1, 1)
    return loss_iou, loss_dfl.sum() / target_scores_sum, iou


def background_stand_ins(foreground, pred_bboxes, target_bboxes) -> tuple:
    """pred_bboxes and target_bboxes (x1, y1, x2, y2), each background anchor's pair replaced by two fixed boxes,
    (0, 0, 1, 1) and (0, 0, 2, 2), whose CIoU terms are finite: a zero weight keeps a term out of the sum only if it
    is finite (0 * inf is NaN): upstream's target there may be a padded box of zero size, and a float16 prediction
    against itself can round its IoU to 1, where CIoU's alpha divides by zero. The background's gradient stops at
    torch.where; foreground values pass unchanged, in their own dtypes."""
    unit_box = torch.arange(4, device=pred_bboxes.device) // 2  # (0, 0, 1, 1)
    return (torch.where(foreground, pred_bboxes, unit_box.to(pred_bboxes.dtype)),
            torch.where(foreground, target_bboxes, 2 * unit_box.to(target_bboxes.dtype)))
