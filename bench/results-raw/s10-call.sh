# The tenth session's device call (2026-12-05; none of its tries got a machine), run as it stands from the
# repository root on the GPU machine (carry .bench, timeout 600): the lever graphed_loss in pairs, then its numbers
# against eager on the GPU, then resident_grads with the time left.
K=$PWD; o=$OUT; mkdir -p $o/gl $o/rg; s=$SECONDS
OUT=$o/gl bash bench/device_call.sh lever --gpus 1 --lever graphed_loss=1 --deadline-s 490
if [ $((SECONDS - s)) -lt 480 ]; then
    python3 bench/prepare_trees.py build /tmp/g/trees --carry .bench >/dev/null 2>&1
    python3 bench/photo_data.py /tmp/g/photos --train 64 --val 16 --scale 0.5 >/dev/null 2>&1
    (cd /tmp/g/trees/kit && timeout $((585 - SECONDS + s)) python3 $K/bench/graphs_equal.py $o/graphs_equal.json \
        --graphed-loss --data /tmp/g/photos/data.yaml --cfg models/detect/yolov9-s.yaml \
        --hyp data/hyps/hyp.scratch-high.yaml --batch-size 16 --imgsz 320 --workers 2 --device 0 --noval --noplots \
        --project /tmp/g/runs 2>&1 | tail -30)
fi
left=$((575 - SECONDS + s))
if [ $left -gt 250 ]; then OUT=$o/rg bash bench/device_call.sh lever --gpus 1 --lever resident_grads=1 --deadline-s $left; fi
