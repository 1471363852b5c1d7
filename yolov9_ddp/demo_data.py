"""A small generated dataset: filled shapes on a noisy background, in YOLO format.

The embedded default of the entry points (no --data), and the tests' data. Every image is a function of (seed,
split, index), and a dataset folder is only ever replaced whole (built beside, renamed).

DemoSpec.labels chooses what the labels are, for each of upstream's tasks:
    boxes     labels/SPLIT/NAME.txt, one "class x y w h" row per shape (detection: train.py, train_dual.py, ...)
    polygons  labels/SPLIT/NAME.txt, one "class x1 y1 x2 y2 ..." row per shape, the outline of the shape drawn
              (instance segmentation: segment/train.py, segment/train_dual.py)
    panoptic  the polygon labels, and the same polygons under stuff/SPLIT/NAME.txt as semantic labels
              (panoptic/train.py)
    classes   one shape per image, filed as SPLIT/CLASS/NAME.jpg (classification: classify/train.py --data ROOT)
All coordinates are normalised to 0-1. The images are the same for boxes, polygons and panoptic.
"""
import argparse
import json
import multiprocessing
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np

CLASS_NAMES = ('rectangle', 'ellipse', 'triangle')
SPEC_FILE = 'demo-spec.json'
LABEL_KINDS = ('boxes', 'polygons', 'panoptic', 'classes')


@dataclass(frozen=True)
class DemoSpec:
    train: int = 256
    val: int = 64
    imgsz: int = 128
    seed: int = 0
    max_objects: int = 4
    labels: str = 'boxes'  # one of LABEL_KINDS

    def __post_init__(self):
        if self.labels not in LABEL_KINDS:
            raise ValueError(f'labels={self.labels!r}: expected one of {", ".join(LABEL_KINDS)}')


def draw_image(spec: DemoSpec, split: str, index: int):
    """One image (HxWx3 uint8) and its shapes: (class, box (x, y, w, h), outline (N x 2 points)), in pixels."""
    rng = np.random.default_rng([spec.seed, 0 if split == 'train' else 1, index])
    size = spec.imgsz
    image = rng.integers(0, 60, (size, size, 3), dtype=np.uint8) + np.uint8(rng.integers(40, 140))
    shapes = []
    count = int(rng.integers(1, spec.max_objects + 1))
    for _ in range(1 if spec.labels == 'classes' else count):
        cls = int(rng.integers(len(CLASS_NAMES)))
        w, h = rng.uniform(0.15, 0.45, 2) * size
        cx, cy = rng.uniform(w / 2, size - w / 2), rng.uniform(h / 2, size - h / 2)
        color = tuple(int(c) for c in rng.integers(150, 256, 3))
        x0, y0, x1, y1 = int(cx - w / 2), int(cy - h / 2), int(cx + w / 2), int(cy + h / 2)
        if cls == 0:
            cv2.rectangle(image, (x0, y0), (x1, y1), color, thickness=-1)
            outline = np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]])
        elif cls == 1:
            center, axes = (int(cx), int(cy)), (int(w / 2), int(h / 2))
            cv2.ellipse(image, center, axes, 0, 0, 360, color, thickness=-1)
            outline = cv2.ellipse2Poly(center, axes, 0, 0, 360, 30)[:-1]  # the last point repeats the first
        else:
            outline = np.array([[int(cx), y0], [x0, y1], [x1, y1]], dtype=np.int32)
            cv2.fillPoly(image, [outline], color)
        shapes.append((cls, ((x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0), outline))
    return image, shapes


def label_text(shapes, kind: str, size: int) -> str:
    """The YOLO label file of an image's shapes: boxes, or polygons for every other kind."""
    if kind == 'boxes':
        return ''.join(f'{c} ' + ' '.join(f'{v / size:.6f}' for v in box) + '\n' for c, box, _ in shapes)
    return ''.join(f'{c} ' + ' '.join(f'{v / size:.6f}' for v in outline.flatten()) + '\n' for c, _, outline in shapes)


def _write_item(root: Path, spec: DemoSpec, split: str, index: int):
    image, shapes = draw_image(spec, split, index)
    name = f'{split}_{index:06d}'
    if spec.labels == 'classes':
        cv2.imwrite(str(root / split / CLASS_NAMES[shapes[0][0]] / f'{name}.jpg'), image)
        return
    cv2.imwrite(str(root / 'images' / split / f'{name}.jpg'), image)
    text = label_text(shapes, spec.labels, spec.imgsz)
    for folder in ('labels', 'stuff') if spec.labels == 'panoptic' else ('labels',):
        (root / folder / split / f'{name}.txt').write_text(text)


def _folders(spec: DemoSpec, split: str) -> list:
    if spec.labels == 'classes':
        return [Path(split, name) for name in CLASS_NAMES]
    return [Path(folder, split) for folder in ('images', 'labels', 'stuff')[:3 if spec.labels == 'panoptic' else 2]]


def write_items(write_item, jobs, processes: int):
    """write_item(*job) for every job, in `processes` processes where that pays: every item is independent of the
    others (drawn by its own seeded generator), so the order they are written in does not matter."""
    if processes > 1 and len(jobs) > 256:
        with multiprocessing.get_context('spawn').Pool(processes) as pool:
            pool.starmap(write_item, jobs, chunksize=64)
    else:
        for job in jobs:
            write_item(*job)


def _write_split(root: Path, spec: DemoSpec, split: str, count: int, processes: int):
    for folder in _folders(spec, split):
        (root / folder).mkdir(parents=True)
    jobs = [(root, spec, split, index) for index in range(count)]
    write_items(_write_item, jobs, processes)


def data_yaml_text(root: Path) -> str:
    names = ''.join(f'  {i}: {name}\n' for i, name in enumerate(CLASS_NAMES))
    return f'path: {root}\ntrain: images/train\nval: images/val\nnames:\n{names}'


def ensure_demo_dataset(root, spec: DemoSpec = DemoSpec(), log=print, processes: int = 1) -> Path:
    """Return root/data.yaml, generating the dataset first unless root already holds this spec."""
    def write(folder: Path):
        log(f'generating demo dataset in {root}: {spec.train} train + {spec.val} val images at {spec.imgsz} px')
        _write_split(folder, spec, 'train', spec.train, processes)
        _write_split(folder, spec, 'val', spec.val, processes)
        (folder / 'data.yaml').write_text(data_yaml_text(Path(root).resolve()))
    return generated_dataset(root, spec, SPEC_FILE, 'a demo dataset', write)


def generated_dataset(root, spec, spec_name: str, kind: str, write) -> Path:
    """root/data.yaml of a generated dataset of `spec`, which root holds or write(folder) writes into a scratch folder
    that then replaces root in one rename (one killed half-way is never taken for whole)."""
    root = Path(root).resolve()
    spec_file = root / spec_name
    if spec_file.is_file() and json.loads(spec_file.read_text()) == asdict(spec):
        return root / 'data.yaml'
    if root.exists() and any(root.iterdir()) and not spec_file.is_file():
        raise FileExistsError(f'{root} exists and is not {kind}; choose another folder')
    root.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f'.{root.name}.', dir=root.parent))
    try:
        write(work)
        (work / spec_name).write_text(json.dumps(asdict(spec), sort_keys=True))
        shutil.rmtree(root, ignore_errors=True)
        os.replace(work, root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root / 'data.yaml'


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('root', type=Path, help='folder to create (data.yaml goes inside)')
    parser.add_argument('--processes', type=int, default=os.cpu_count(), help='image writers in parallel')
    for field, default in asdict(DemoSpec()).items():
        if field == 'labels':
            parser.add_argument('--labels', choices=LABEL_KINDS, default=default)
        else:
            parser.add_argument(f'--{field.replace("_", "-")}', type=int, default=default)
    args = parser.parse_args(argv)
    spec = DemoSpec(**{k: v for k, v in vars(args).items() if k not in ('root', 'processes')})
    print(ensure_demo_dataset(args.root, spec, processes=args.processes))


if __name__ == '__main__':
    main()
