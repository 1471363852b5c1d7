# The ninth session's CPU pairs for the writer process's preload (cpu-s9-preload.json), here, in this order:
#   python bench/prepare_trees.py build /tmp/kit-trees     # at ef9411a (old)
#   python bench/prepare_trees.py build /tmp/kit-new       # with the preload (new)
#   the data: ensure_demo_dataset('/tmp/cwdata', DemoSpec(train=4000, val=8, imgsz=64)) of yolov9_ddp.demo_data
for i in 0 1 2; do for side in old new; do
  tree=/tmp/kit-trees; [ $side = new ] && tree=/tmp/kit-new
  cd $tree/kit && rm -rf /tmp/cwruns-$side-$i && timeout 300 /work/main/.venv/bin/python /work/main/bench/ckpt_windows.py /tmp/pre/$side-$i.json --window-s 6 --pairs 2 --data /tmp/cwdata/data.yaml --cfg yolov9_ddp/models/tiny-dual.yaml --epochs 1 --batch-size 8 --imgsz 64 --device cpu --workers 0 --noval --noplots --project /tmp/cwruns-$side-$i --levers checkpoint_process=1,progress_every=2 > /tmp/pre/$side-$i.log 2>&1; echo "$side $i rc $?"
done; done
