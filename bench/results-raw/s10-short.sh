# The tenth session's short device call, for when under 10 minutes of device time are left (carry .bench):
# does CUDA capture the lever graphed_loss, with the eager numbers (graphs_equal --graphed-loss), and does a run
# train with it (two epochs of 64 photographs at 320 px; its log's tail and peak memory)?
K=$PWD; o=$OUT
python3 bench/prepare_trees.py build /tmp/g/trees --carry .bench > $o/build.txt 2>&1
python3 bench/photo_data.py /tmp/g/photos --train 64 --val 16 --scale 0.5 > /dev/null 2>&1
cd /tmp/g/trees/kit
args="--data /tmp/g/photos/data.yaml --cfg models/detect/yolov9-s.yaml --hyp data/hyps/hyp.scratch-high.yaml
      --batch-size 16 --imgsz 320 --workers 4 --device 0 --project /tmp/g/runs"
timeout 150 python3 $K/bench/graphs_equal.py $o/graphs_equal.json --graphed-loss $args --noval --noplots 2>&1 | tail -25
timeout 170 python3 ddp_train_dual.py $args --epochs 2 --name gl --levers graphed_loss=1 > $o/train.txt 2>&1
echo "train exit $?"; tail -25 $o/train.txt
