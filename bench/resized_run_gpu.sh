#!/usr/bin/env bash
# Issue 21's resized run as a user would try it on a machine of one GPU: yolov9-s on the bench's photographs,
# started on the GPU (1 process, global batch 16), SIGTERMed inside epoch 1 and resumed with nothing but --resume
# on 2 CPU processes (--device cpu: each takes 8 of the 16), SIGTERMed again inside epoch 2 and resumed on the GPU
# with 1 process, where it completes. The log keeps each start's "resuming epoch E at step S of N" line and the
# BatchNorm warning of a resize. One device call (carry [".bench"]):
#
#   bash bench/resized_run_gpu.sh        writes $OUT/log.txt and each start's log
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder for the results}"
work=/tmp/resized-run
exec > >(tee "$OUT/log.txt") 2>&1
python3 bench/prepare_trees.py build "$work/trees" --carry .bench || exit 1
python3 bench/photo_data.py "$work/photos" --train 480 --val 64 --scale 0.5 || exit 1
cd "$work/trees/kit" || exit 1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
run=$work/runs/resized
last=$run/weights/last.pt
started=$SECONDS
launch() {  # launch LOG ARGS...: torchrun in the background, in a session of its own ($! is torchrun's pid)
    local log=$1; shift
    setsid python3 -m torch.distributed.run --standalone "$@" > "$OUT/$log" 2>&1 &
}
past() {  # past EPOCH STEP: run.json records a checkpoint at or past (EPOCH, STEP)
    python3 -c "import json, sys; p = json.load(open('$run/run.json')).get('saved_position') or [0, 0]
sys.exit(0 if p >= [$1, $2] else 1)" 2>/dev/null
}
stop_when_past() {  # stop_when_past EPOCH STEP PID: SIGTERM the job once a checkpoint is at or past (EPOCH, STEP)
    while kill -0 "$3" 2>/dev/null && ! past "$1" "$2"; do sleep 0.2; done
    kill -TERM "$3"; wait "$3"; echo "exit $? (SIGTERM once a checkpoint was at or past epoch $1 step $2)"
}
echo "--- start: 1 process on the GPU"
launch gpu-1.log --nproc_per_node 1 ddp_train_dual.py --data "$work/photos/data.yaml" \
    --cfg models/detect/yolov9-s.yaml --hyp data/hyps/hyp.scratch-high.yaml --epochs 3 --batch-size 16 --imgsz 320 \
    --workers 4 --save-on-signal --checkpoint-steps 5 --noplots --project "$work/runs" --name resized
stop_when_past 1 5 $!
echo "--- resumed on 2 CPU processes"
launch cpu-2.log --nproc_per_node 2 ddp_train_dual.py --resume "$last" --device cpu --workers 2 --checkpoint-steps 5
stop_when_past 2 5 $!
echo "--- resumed on 1 process on the GPU"
launch gpu-1-again.log --nproc_per_node 1 ddp_train_dual.py --resume "$last" --device 0
wait $!; echo "exit $?"
grep -a -h -E 'resuming epoch|BatchNorm|stopped on SIGTERM|epochs completed|Final:|error' \
    "$OUT/gpu-1.log" "$OUT/cpu-2.log" "$OUT/gpu-1-again.log"
echo "results.csv rows: $(($(wc -l < "$run/results.csv") - 1))"
nvidia-smi --query-gpu=name --format=csv,noheader
echo "total $((SECONDS - started)) s"
