"""A few DDP training steps (gloo, one process per torchrun rank) of a tiny segmentation model with upstream's loss,
where every batch of rank 1 has no targets and no masks: what stopped segmentation under DDP (yolov9#559).

    torchrun --nproc_per_node 2 ddp_no_targets.py LOSS_MODULE CFG STATIC_GRAPH [LOSS_MODULE CFG STATIC_GRAPH ...]
                                                                                    (cwd: a YOLOv9 tree)

LOSS_MODULE is upstream's segmentation loss (utils.segment.loss_tal or utils.segment.loss_tal_dual); STATIC_GRAPH is
0 (the kit's DDP) or 1 (upstream's smart_DDP). The cases run one after the other in one process group (one job
start for all); rank 0 prints 'trained N steps: LOSS_MODULE CFG STATIC_GRAPH' when every step of a case finished.
A case that fails ends the job, as it ends a training. The tree need not hold the kit: the tests run this in the
pinned tree patched without 0012 too.
"""
import importlib
import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from models.yolo import Model  # noqa: E402

STEPS = 3


def batch(rank: int):
    """Two 64 px images; rank 0's hold one object each, rank 1's none (a background-only batch)."""
    generator = torch.Generator().manual_seed(rank)
    images = torch.rand(2, 3, 64, 64, generator=generator)
    masks = torch.zeros(2, 16, 16)  # --mask-ratio 4, overlap format
    if rank:
        return images, torch.zeros(0, 6), masks
    masks[0, 4:12, 4:12] = 1
    masks[1, 4:8, 4:8] = 1
    return images, torch.tensor([[0, 0, 0.5, 0.5, 0.5, 0.5], [1, 2, 0.375, 0.375, 0.25, 0.25]]), masks


def train(rank: int, loss_module: str, cfg: str, static_graph: bool):
    torch.manual_seed(0)
    model = Model(cfg, ch=3, nc=3).train()
    model.hyp = yaml.safe_load((ROOT / 'data' / 'hyps' / 'hyp.scratch-high.yaml').read_text())
    compute_loss = importlib.import_module(loss_module).ComputeLoss(model, overlap=True)
    ddp = DistributedDataParallel(model, static_graph=static_graph)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images, targets, masks = batch(rank)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss, _ = compute_loss(ddp(images), targets, masks)
        loss.backward()
        optimizer.step()


def main():
    cases = sys.argv[1:]
    dist.init_process_group('gloo', timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    for loss_module, cfg, static_graph in zip(*[iter(cases)] * 3):
        train(rank, loss_module, cfg, static_graph == '1')
        dist.barrier()
        if rank == 0:
            print(f'trained {STEPS} steps: {loss_module} {cfg} {static_graph}', flush=True)
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
    sys.path.append(str(Path(__file__).resolve().parents[2]))  # the kit, after the tree (which may not hold it)
    from yolov9_ddp.failures import exit_without_teardown
    exit_without_teardown(0)  # as the entry points end a run: the teardown of torch costs 0.5 to 1 s
