#!/usr/bin/env bash
# alternate: the kit as committed (gc frozen after set-up) | the same with freeze_long_lived_objects a no-op
cd /work/main/.bench/trees/kit
args="--window-s 8 --pairs 1 --data /tmp/cc/demo400/data.yaml --cfg models/detect/yolov9-s.yaml --hyp data/hyps/hyp.scratch-high.yaml --batch-size 2 --imgsz 64 --epochs 1 --device cpu --workers 1 --noplots --noval --project /tmp/gcb/runs --name w --exist-ok"
for i in 0 1 2; do
  /work/main/.venv/bin/python - /tmp/gcb/off-$i.json $args > /tmp/gcb/off-$i.log 2>&1 <<'PY'
import runpy, sys
sys.argv[0] = '/work/main/bench/ckpt_windows.py'
sys.path.insert(0, '/work/main/.bench/trees/kit')
import yolov9_ddp.trainer as trainer
trainer.freeze_long_lived_objects = lambda: None
runpy.run_path(sys.argv[0], run_name='__main__')
PY
  /work/main/.venv/bin/python /work/main/bench/ckpt_windows.py /tmp/gcb/on-$i.json $args > /tmp/gcb/on-$i.log 2>&1
done
