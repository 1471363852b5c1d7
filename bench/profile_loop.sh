#!/usr/bin/env bash
# Where the kit's training loop spends its time on a GPU (issue 23: the loop trails its GPU-only step): py-spy
# samples the training process (its threads, idle time included) for 10 s of the second of 3 epochs of yolov9-s at
# 640 px, batch 32, on 2048 of the bench's photographs, 12 loader workers, while bench/cpu_share.py reads the CPU
# each of its threads and its loader workers used in the same 10 s. py-spy travels in .bench/tools (copied from a
# venv with `pip install py-spy`; the GPU machine has no package registry). One device call (carry [".bench"]):
#
#   bash bench/profile_loop.sh [NAME [TRAINING OPTIONS...]]
#       writes $OUT/NAME.raw (py-spy's folded stacks, per thread), $OUT/NAME.cpu.json and $OUT/NAME.log (the
#       training's output); NAME defaults to loop. Several in one call, e.g. with and without --cache ram:
#       bash bench/profile_loop.sh plain && bash bench/profile_loop.sh ram --cache ram
#   PYSPY=0 bash bench/profile_loop.sh ...   the same without py-spy (it pauses the process 100 times a second,
#       which slows the second epoch): the CPU shares and the epochs' pace only
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder for the results}"
name=${1:-loop}
shift $(($# > 0))
kit=$PWD work=/tmp/profile-loop
python3 bench/prepare_trees.py build "$work/trees" --carry .bench >> "$OUT/prepare.log" 2>&1 || exit 1
python3 bench/photo_data.py "$work/photos" --train 2048 --val 64 >> "$OUT/prepare.log" 2>&1 || exit 1
cd "$work/trees/kit" || exit 1
export PYTHONUNBUFFERED=1
python3 ddp_train_dual.py --data "$work/photos/data.yaml" --cfg models/detect/yolov9-s.yaml \
    --hyp data/hyps/hyp.scratch-high.yaml --epochs 3 --batch-size 32 --imgsz 640 --workers 16 --device 0 --noval \
    --noplots --project "$work/runs" --name "$name" --exist-ok "$@" > "$OUT/$name.log" 2>&1 &
pid=$!
until grep -a -q '^epoch 0:' "$OUT/$name.log" || ! kill -0 $pid 2>/dev/null; do sleep 0.5; done
sleep 1  # into the second epoch: past cudnn's autotuning and the first epoch's caches
python3 "$kit/bench/cpu_share.py" $pid 10 "$OUT/$name.cpu.json" > /dev/null 2>&1 &
if [ "${PYSPY:-1}" = 1 ]; then  # PYSPY=0: the CPU shares only (py-spy pauses the process 100 times a second)
    "$kit/.bench/tools/py-spy" record --pid $pid --threads --idle --rate 100 --duration 10 --format raw \
        --output "$OUT/$name.raw" > "$OUT/$name.py-spy.log" 2>&1
    tail -1 "$OUT/$name.py-spy.log"
fi
wait $pid; echo "$name: exit $?"; grep -a -E '^epoch [0-9]' "$OUT/$name.log"
wait; cat "$OUT/$name.cpu.json"; echo
