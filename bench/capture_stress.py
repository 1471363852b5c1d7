#!/usr/bin/env python3
"""Whether CUDA graph captures of yolov9-s fail while a loader's pin-memory thread works beside them, in torch's
default capture mode ('global') against the kit's (yolov9_ddp.graphs.captures_checking_this_thread: 'thread_local').
Issue 23: one capture of five under --deterministic failed in cuDNN (bench/RESULTS.md, calls 7 and 8).

    cd KIT_TREE && python3 KIT/bench/capture_stress.py OUT.json --mode global|kit [--captures 12] [--deterministic]

Each round takes 8 batches from a DataLoader of random images (8 workers, pin_memory=True, as training's), copies
them to the GPU and drops them, so that the pin-memory thread pins the next ones and reuses the blocks they leave,
while a fresh copy of yolov9-s (batch 16, 640 px, channels-last, under autocast) is captured at once, as the
training thread does at its first step. A failed capture ends the count (the CUDA context is not to be trusted
after it): run each mode in a process of its own. OUT.json: the mode, the captures tried and passed, the error.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')  # before CUDA starts, for --deterministic
sys.path.insert(0, str(Path.cwd()))  # the kit tree: upstream's models and the kit's yolov9_ddp
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

BATCH, IMGSZ, TAKEN_A_ROUND = 16, 640, 8


class RandomImages(Dataset):
    def __len__(self):
        return 10 ** 6

    def __getitem__(self, index):
        return torch.randint(0, 255, (3, IMGSZ, IMGSZ), dtype=torch.uint8)


def capture(mode: str, model, sample):
    from yolov9_ddp import graphs
    if mode == 'kit':
        return graphs.capture_graphs(model, sample)
    torch.cuda.make_graphed_callables(model, (sample.clone(),), allow_unused_input=True)
    return model.forward


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', type=Path)
    p.add_argument('--mode', choices=('global', 'kit'), required=True)
    p.add_argument('--captures', type=int, default=12)
    p.add_argument('--deterministic', action='store_true', help="upstream's numerics, as --deterministic trains")
    args = p.parse_args()
    from models.yolo import Model
    torch.backends.cudnn.benchmark = not args.deterministic
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
    loader = iter(DataLoader(RandomImages(), batch_size=BATCH, num_workers=8, pin_memory=True, prefetch_factor=4,
                             persistent_workers=True))
    template = Model('models/detect/yolov9-s.yaml', ch=3, nc=80)
    record = {'mode': args.mode, 'deterministic': args.deterministic, 'torch': torch.__version__, 'tried': 0,
              'passed': 0, 'seconds': []}
    for _ in range(args.captures):
        model = Model('models/detect/yolov9-s.yaml', ch=3, nc=80)
        model.load_state_dict(template.state_dict())
        model = model.cuda().to(memory_format=torch.channels_last).train()
        for _ in range(TAKEN_A_ROUND):  # the pin-memory thread refills the queue while the capture runs
            images = next(loader).cuda(non_blocking=True)
        sample = (images.float() / 255).contiguous(memory_format=torch.channels_last)
        del images
        record['tried'] += 1
        started = time.perf_counter()
        try:
            with torch.amp.autocast('cuda', cache_enabled=False):
                graphed = capture(args.mode, model, sample)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (what fails is the finding)
            record['error'] = f'{type(e).__name__}: {e}'.splitlines()[0][:500]
            break
        record['passed'] += 1
        record['seconds'].append(round(time.perf_counter() - started, 2))
        del graphed, model, sample
        torch.cuda.empty_cache()
        args.out.write_text(json.dumps(record, indent=1))
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k != 'seconds'}))
    os._exit(0)  # the loader's workers and a failed capture's state: no teardown


if __name__ == '__main__':
    main()
