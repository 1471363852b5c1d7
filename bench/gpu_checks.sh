#!/usr/bin/env bash
# What the kit changed since its last device session, checked on a GPU in one device call (carry [".bench"]),
# about 5 minutes:
#   1. the multi-tensor EMA update is upstream's ModelEMA.update bit for bit on CUDA, whose multi-tensor kernels
#      must round as its single-tensor ones (tests/test_levers.py's test, called with device 'cuda': the tests'
#      own fixtures need git, which the machine may lack);
#   2. AutoBatch (--batch-size -1) measures on a GPU under the kit's defaults (cudnn.benchmark, which made upstream's
#      autobatch() answer 16 unmeasured, is off while it measures), chooses more than 16, records it in opt.yaml and
#      trains an epoch at it without running out of memory (cudnn's benchmark workspaces come on top of its 80%);
#   3. CUDA graph captures of yolov9-s under --deterministic beside a loader's pin-memory thread, 12 in torch's
#      default capture mode and 12 in the kit's (bench/capture_stress.py): whether the kit's mode is why none fails
#      (one of five failed in calls 7 and 8); the kit's failing one is a failed check, torch's mode is reported.
#
#   bash bench/gpu_checks.sh      writes $OUT/log.txt and $OUT/capture-{global,kit}.json; exit 0 where 1 to 3 hold
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder for the results}"
kit=$PWD work=/tmp/gpu-checks
exec > >(tee "$OUT/log.txt") 2>&1
python3 bench/prepare_trees.py build "$work/trees" --carry .bench || exit 1
python3 bench/photo_data.py "$work/photos" --train 768 --val 16 || exit 1
status=0

echo "== 1. the multi-tensor EMA against upstream's ModelEMA.update, on CUDA"
python3 - "$work/trees/kit" <<'EOF' || status=1
import sys
sys.path[:0] = [sys.argv[1], 'tests']  # upstream's modules from the kit tree; the test module from this checkout
from test_levers import test_ema_multi_tensor_update_is_upstreams_bit_for_bit as bit_for_bit
for validated_between in (False, True):
    bit_for_bit(validated_between, 'cuda')
print('the EMA: bit for bit on CUDA, with and without a validation between its updates')
EOF

echo "== 2. AutoBatch on the GPU, one epoch of 768 photographs at 640 px"
started=$SECONDS
(cd "$work/trees/kit" && python3 ddp_train_dual.py --data "$work/photos/data.yaml" --cfg models/detect/yolov9-s.yaml \
    --hyp data/hyps/hyp.scratch-high.yaml --epochs 1 --batch-size -1 --imgsz 640 --workers 8 --noval --noplots \
    --project "$work/runs" --name autobatch) > "$work/autobatch.log" 2>&1 || status=1
echo "exit after $((SECONDS - started)) s"
grep -a -E 'AutoBatch|levers|^epoch 0|out of memory|Error' "$work/autobatch.log" | cut -c1-300
python3 -c "import sys, yaml; batch = yaml.safe_load(open(sys.argv[1]))['batch_size']; print('opt.yaml batch_size:', batch)
sys.exit(0 if batch > 16 else 1)" "$work/runs/autobatch/opt.yaml" || status=1
nvidia-smi --query-gpu=memory.total --format=csv,noheader

echo "== 3. graph captures beside a pin-memory thread, --deterministic: torch's capture mode, then the kit's"
for mode in global kit; do
    (cd "$work/trees/kit" && python3 "$kit/bench/capture_stress.py" "$OUT/capture-$mode.json" --mode "$mode" \
        --captures 12 --deterministic > "$work/capture-$mode.log" 2>&1) || status=1
    tail -1 "$work/capture-$mode.log" | cut -c1-600
done
python3 -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['passed'] == 12 else 1)" \
    "$OUT/capture-kit.json" || status=1
exit $status
