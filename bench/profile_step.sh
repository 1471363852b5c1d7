#!/usr/bin/env bash
# Where the GPU-only step's time goes on a GPU (issue 23: can --deterministic be 1.15x upstream without changing its
# numerics?): bench/gpu_step.py --profile times 40 steps of yolov9-s at 640 px, batch 32, then profiles 10 more, for
# the kit's defaults, the kit with --deterministic, the same with torch's NaN fill of new tensors (upstream's setting:
# the lever fill_uninitialized=1; its memsets show as aten::fill_), the kit without its one-GPU defaults (eager,
# NCHW) and upstream's step with its own settings. Each writes $OUT/NAME.json: img/s, the GPU's busy time a step against the
# step's wall time, and the operators that take most of the GPU's time. One device call (carry [".bench"]), about 4
# min:
#
#   bash bench/profile_step.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder for the results}"
kit=$PWD work=/tmp/profile-step
python3 bench/prepare_trees.py build "$work/trees" --carry .bench > "$OUT/prepare.log" 2>&1 || exit 1
python3 bench/photo_data.py "$work/photos" --train 64 --val 16 >> "$OUT/prepare.log" 2>&1 || exit 1
step() {  # NAME TREE SETTINGS [OPTIONS...]
    local name=$1 tree=$2 settings=$3
    shift 3
    (cd "$work/trees/$tree" && python3 "$kit/bench/gpu_step.py" "$OUT/$name.json" --settings "$settings" \
        --profile 10 --data "$work/photos/data.yaml" --cfg models/detect/yolov9-s.yaml \
        --hyp data/hyps/hyp.scratch-high.yaml --batch-size 32 --imgsz 640 --device 0 --workers 4 --noplots \
        --project "$work/runs" --name "$name" --exist-ok "$@") > "$OUT/$name.log" 2>&1
    echo "$name: exit $?"
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); p = d['profile']
print(d['img_per_s'], 'img/s;', p['busy_ms_per_step'], 'of', p['wall_ms_per_step'], 'ms a step busy')
for name, ms, share in p['ops'][:8]: print(f'  {share:6.1%} {ms:8.2f} ms  {name}')" "$OUT/$name.json"
}
step kit-defaults kit kit
step kit-deterministic kit kit --deterministic
step kit-deterministic-nan-fill kit kit --deterministic --levers fill_uninitialized=1
step kit-eager-nchw kit kit --levers cuda_graphs=0,channels_last=0
step upstream upstream upstream
