#!/usr/bin/env bash
# Where the kit's training loop spends its time on a GPU (issue 23: the loop trails its GPU-only step): py-spy
# samples the training process (its threads, idle time included) for 10 s of the second of 3 epochs of yolov9-s at
# 640 px, batch 32, on 2048 of the bench's photographs, 12 loader workers. py-spy travels in .bench/tools (copied from a venv with
# `pip install py-spy`; the GPU machine has no package registry). One device call (carry [".bench"]):
#
#   bash bench/profile_loop.sh        writes $OUT/loop.raw (py-spy's folded stacks, per thread) and $OUT/train.log
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder for the results}"
kit=$PWD work=/tmp/profile-loop
python3 bench/prepare_trees.py build "$work/trees" --carry .bench > "$OUT/prepare.log" 2>&1 || exit 1
python3 bench/photo_data.py "$work/photos" --train 2048 --val 64 >> "$OUT/prepare.log" 2>&1 || exit 1
cd "$work/trees/kit" || exit 1
export PYTHONUNBUFFERED=1
python3 ddp_train_dual.py --data "$work/photos/data.yaml" --cfg models/detect/yolov9-s.yaml \
    --hyp data/hyps/hyp.scratch-high.yaml --epochs 3 --batch-size 32 --imgsz 640 --workers 16 --device 0 --noval \
    --noplots --project "$work/runs" --name loop > "$OUT/train.log" 2>&1 &
pid=$!
until grep -a -q '^epoch 0:' "$OUT/train.log" || ! kill -0 $pid 2>/dev/null; do sleep 0.5; done
sleep 1  # into the second epoch: past cudnn's autotuning and the first epoch's caches
"$kit/.bench/tools/py-spy" record --pid $pid --threads --idle --rate 100 --duration 10 --format raw \
    --output "$OUT/loop.raw" > "$OUT/py-spy.log" 2>&1
wait $pid; echo "exit $?"; grep -a -E '^epoch [0-9]' "$OUT/train.log"; tail -3 "$OUT/py-spy.log"
