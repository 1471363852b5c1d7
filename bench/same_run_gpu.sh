#!/usr/bin/env bash
# Issue 21 on a GPU, as a user would run it: --deterministic training of yolov9-s on the bench's photographs,
# uninterrupted, SIGTERMed inside an epoch and resumed (--save-on-signal), and SIGKILLed inside an epoch and
# restarted by torchrun from its periodic checkpoint (--checkpoint-steps), and uninterrupted with 2 loader workers
# instead of 4; their final full checkpoints (epoch2.pt: model, EMA, optimizer state) compared bit for bit. One device
# call (carry [".bench"]). (Its run `graphs`, with the lever cuda_graphs=1, went when --deterministic came to refuse
# the lever: bench/RESULTS.md, calls 7 and 8.)
#
#   bash bench/same_run_gpu.sh [RUN...]   RUN: stopped, killed, fewer-workers (all three if none are named);
#                                         writes $OUT/log.txt and $OUT/same_run.json
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder for the results}"
kit=$PWD work=/tmp/same-run
runs=(${*:-stopped killed fewer-workers})
wanted() { [[ " ${runs[*]} " == *" $1 "* ]]; }
exec > >(tee "$OUT/log.txt") 2>&1
python3 bench/prepare_trees.py build "$work/trees" --carry .bench || exit 1
python3 bench/photo_data.py "$work/photos" --train 480 --val 64 --scale 0.5 || exit 1
data=$work/photos/data.yaml
cd "$work/trees/kit" || exit 1
export PYTHONUNBUFFERED=1
train=(ddp_train_dual.py --data "$data" --cfg models/detect/yolov9-s.yaml --hyp data/hyps/hyp.scratch-high.yaml
       --epochs 3 --batch-size 16 --imgsz 320 --workers 4 --deterministic --save-period 1 --noval --noplots
       --project "$work/runs")
launch() {  # launch NAME MAX_RESTARTS ARGS...: torchrun, one process, in the background
    local name=$1 restarts=$2; shift 2
    setsid python3 -m torch.distributed.run --standalone --nproc_per_node 1 --max-restarts "$restarts" "${train[@]}" --name "$name" "$@" \
        > "$work/$name.log" 2>&1 &
}
past() {  # past NAME EPOCH STEP: run.json records a checkpoint at or past (EPOCH, STEP)
    python3 -c "import json, sys; p = json.load(open('$work/runs/$1/run.json')).get('saved_position') or [0, 0]
sys.exit(0 if p >= [$2, $3] else 1)" 2>/dev/null
}
when_past() {  # when_past NAME EPOCH STEP PID: wait for it (or for the job's end)
    while kill -0 "$4" 2>/dev/null && ! past "$1" "$2" "$3"; do sleep 0.2; done
}
started=$SECONDS
launch reference 0; wait $!; rc=$?; echo "reference: exit $rc after $((SECONDS - started)) s"
[ "$rc" = 0 ] || { tail -30 "$work/reference.log"; exit 1; }

if wanted stopped; then
  launch stopped 0 --save-on-signal --checkpoint-steps 5; pid=$!
  when_past stopped 1 5 $pid; kill -TERM $pid; wait $pid; echo "stopped: exit $? (SIGTERM inside epoch 1)"
  grep -a 'stopped on SIGTERM' "$work/stopped.log"
  setsid python3 -m torch.distributed.run --standalone --nproc_per_node 1 ddp_train_dual.py --resume "$work/runs/stopped/weights/last.pt" \
      > "$work/stopped-resume.log" 2>&1; echo "stopped, resumed: exit $?"
  grep -a 'resuming epoch' "$work/stopped-resume.log"
fi
if wanted killed; then
  launch killed 1 --checkpoint-steps 5; pid=$!
  when_past killed 1 5 $pid
  worker=$(pgrep -P "$pid" -f ddp_train_dual.py | head -1)
  kill -KILL "$worker"; echo "killed: SIGKILL to the training process $worker inside epoch 1"
  wait $pid; echo "killed, restarted by torchrun: exit $?"
  grep -a 'resuming epoch' "$work/killed.log"
fi
if wanted fewer-workers; then
  launch fewer-workers 0 --workers 2; wait $!; echo "fewer-workers (2 loader workers instead of 4): exit $?"
fi
nvidia-smi --query-gpu=name --format=csv,noheader

python3 - "$work/runs" "$OUT/same_run.json" "${runs[@]}" <<'PY'
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, '.')
runs, out = Path(sys.argv[1]), Path(sys.argv[2])

def tensors(name):
    ckpt = torch.load(runs / name / 'weights' / 'epoch2.pt', map_location='cpu', weights_only=False)
    found = {f'{k}.{n}': t for k in ('model', 'ema') for n, t in ckpt[k].state_dict().items()}
    for i, state in ckpt['optimizer']['state'].items():
        found.update({f'optimizer.{i}.{n}': t for n, t in state.items() if torch.is_tensor(t)})
    return found, ckpt['updates']

reference, updates = tensors('reference')
report = {'gpu': torch.cuda.get_device_name(0), 'tensors': len(reference), 'updates': updates}
for name in sys.argv[3:]:
    other, other_updates = tensors(name)
    differ = [k for k in reference if not torch.equal(reference[k], other[k])]
    report[name] = {'updates': other_updates, 'differing_tensors': len(differ), 'first': differ[:5]}
print(json.dumps(report, indent=1))
out.write_text(json.dumps(report, indent=1))
PY
cp "$work"/*.log "$OUT/"
echo "total $((SECONDS - started)) s"
