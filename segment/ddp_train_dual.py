#!/usr/bin/env python3
"""Distributed training of YOLOv9 dual-head segmentation models (DualDSegment), a drop-in for
segment/train_dual.py.

    torchrun --nproc_per_node N segment/ddp_train_dual.py ARGS   N GPUs (NCCL), or N CPU processes with --device cpu
                                                                 (gloo)
    python segment/ddp_train_dual.py ARGS                        one process, as segment/train_dual.py

ARGS are segment/train_dual.py's flags (see --help). Installed into a YOLOv9 clone by apply_patches.py. The training
loop (yolov9_ddp.trainer) is shared by every entry point; yolov9_ddp.tasks says what differs between them.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the YOLOv9 clone: upstream's modules and the kit's yolov9_ddp/
sys.path.insert(0, str(ROOT))

from yolov9_ddp.entry import main  # noqa: E402
from yolov9_ddp.failures import end_process  # noqa: E402

if __name__ == '__main__':
    end_process(main('segment-dual', root=ROOT))
