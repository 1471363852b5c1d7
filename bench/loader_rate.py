#!/usr/bin/env python3
"""Images per second of the kit's training loader alone (upstream's mosaic pipeline, the kit's DataLoader), with
or without --cache ram: what the shared RAM cache saves when no GPU waits for it.

    python bench/loader_rate.py TRAIN_ARGS... [--batches B]      (cwd: the kit tree; one process)

Takes --data, --imgsz, --batch-size, --workers, --cache from TRAIN_ARGS; loads 3 batches untimed (workers start),
then times B batches and prints one JSON line.
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from utils.general import check_dataset  # noqa: E402
from yolov9_ddp import cli, data  # noqa: E402
from yolov9_ddp.levers import levers_for  # noqa: E402
from yolov9_ddp.tasks import TASKS  # noqa: E402

TASK = TASKS['detect-dual']


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--batches', type=int, default=30)
    args, train_args = p.parse_known_args()
    opt = cli.parse_args(train_args, ROOT, TASK)
    hyp = yaml.safe_load(Path(opt.hyp).read_text())
    loader, dataset = data.train_loader(TASK, check_dataset(opt.data)['train'], opt.imgsz, opt.batch_size, 32, opt,
                                        hyp, levers_for(opt), False, '')
    batches = (batch for _ in iter(int, 1) for batch in loader)  # epoch after epoch
    for _ in range(3):
        next(batches)
    started, images = time.perf_counter(), 0
    for _ in range(args.batches):
        images += len(next(batches)[0])
    seconds = time.perf_counter() - started
    print(json.dumps({'cache': opt.cache, 'workers': loader.num_workers, 'batch': opt.batch_size,
                      'img_per_s': round(images / seconds, 1)}))


if __name__ == '__main__':
    main()
