#!/usr/bin/env python3
"""The benchmarks' detection dataset: photographs, so that decoding and augmenting cost what they cost on COCO.

    python bench/photo_data.py ROOT [--train N] [--val N] [--scale S] [--processes P]    (prints ROOT/data.yaml)

Objects of five classes are crops of scikit-image's sample photographs (a cat's face, a cup of coffee, a rocket, an
astronaut's face, a motorcycle), scaled, stretched, flipped and brightened or darkened, pasted onto backgrounds cut,
scaled, flipped and tinted from its detailed sample images (the Hubble deep field, microscopy, grass, gravel, ...),
with sensor noise, at the sizes COCO's images come in (640 x 480, 480 x 640, 640 x 427, ...). At JPEG quality 90
the files weigh about what COCO's do (about 100 KB on average at full scale, most between 70 and 150). Every image
is a pure function of (spec, split, index), and a dataset folder is only ever replaced whole (built beside,
renamed), as the demo dataset's (yolov9_ddp/demo_data.py).

Drawing needs scikit-image (the GPU machine's image has it; elsewhere `pip install scikit-image`); the module
imports without it, and its geometry (compose) works on any arrays.
"""
import argparse
import functools
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the kit, when run as a script
from yolov9_ddp.demo_data import generated_dataset, write_items  # noqa: E402

OBJECTS = {  # class: (skimage.data sample, crop x0, y0, x1, y1 in its pixels)
    'cat': ('chelsea', 80, 30, 380, 285),
    'cup': ('coffee', 75, 15, 485, 390),
    'rocket': ('rocket', 298, 120, 345, 410),
    'face': ('astronaut', 150, 15, 305, 185),
    'motorcycle': ('stereo_motorcycle', 90, 55, 690, 460),
}
BACKGROUNDS = ('hubble_deep_field', 'immunohistochemistry', 'brick', 'grass', 'gravel', 'coins', 'camera')  # detailed
SIZES = ((640, 480), (480, 640), (640, 427), (427, 640), (640, 360), (500, 375), (375, 500), (640, 512), (612, 612),
         (640, 425))  # width, height: COCO's commonest
MAX_OVERLAP = 0.3  # a new object may cover at most this share of an earlier one (which keeps its box)


@dataclass(frozen=True)
class PhotoSpec:
    train: int = 4096
    val: int = 1000
    seed: int = 0
    max_objects: int = 8
    scale: float = 1.0  # of the image sizes (0.5: 320 x 240, ...)
    jpeg_quality: int = 90

    def draw(self, split: str, index: int):
        rng = np.random.default_rng([self.seed, 0 if split == 'train' else 1, index])
        return compose(rng, photo_sources(), self.scale, self.max_objects)


@dataclass(frozen=True)
class Sources:
    objects: tuple  # one BGR crop per class, in class order
    backgrounds: tuple  # BGR or grey images


@functools.cache
def photo_sources() -> Sources:
    """scikit-image's sample photographs, loaded once per process."""
    try:
        import skimage.data
    except ImportError:
        raise SystemExit('bench/photo_data.py draws from scikit-image\'s sample photographs: pip install scikit-image')

    def load(name):
        image = getattr(skimage.data, name)()
        image = image[0] if isinstance(image, tuple) else image  # stereo_motorcycle: (left, right, disparity)
        return np.ascontiguousarray(image[..., ::-1]) if image.ndim == 3 else image  # RGB -> BGR

    objects = tuple(load(name)[y0:y1, x0:x1] for name, x0, y0, x1, y1 in OBJECTS.values())
    return Sources(objects, tuple(load(name) for name in BACKGROUNDS))


# -- composing an image ------------------------------------------------------------------------------------------------

def background(rng, image, width: int, height: int):
    """A crop of image at 0.5-1x its own resolution (mirrored where it is too small, as textures tile), width x
    height, flipped and tinted, BGR, with sensor noise: detail enough to weigh and decode like a photograph."""
    zoom = rng.uniform(0.5, 1.0)
    h, w = image.shape[:2]
    resized = cv2.resize(image, (round(w * zoom), round(h * zoom)), interpolation=cv2.INTER_AREA)
    resized = cv2.copyMakeBorder(resized, 0, max(0, height - resized.shape[0]), 0, max(0, width - resized.shape[1]),
                                 cv2.BORDER_REFLECT)
    y, x = rng.integers(0, resized.shape[0] - height + 1), rng.integers(0, resized.shape[1] - width + 1)
    crop = resized[y:y + height, x:x + width]
    crop = crop[:, ::-1] if rng.random() < 0.5 else crop
    crop = crop[..., None].repeat(3, 2) if crop.ndim == 2 else crop
    tint = rng.uniform(0.6, 1.2, 3) if image.ndim == 2 else rng.uniform(0.85, 1.15, 3)
    noisy = crop * tint.astype(np.float32) + rng.normal(0, rng.uniform(4, 10), crop.shape).astype(np.float32)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def object_patch(rng, crop, size: int):
    """The crop scaled so that its longer side is about size, stretched a little, maybe flipped, brightness jittered."""
    h, w = crop.shape[:2]
    stretch = rng.uniform(0.85, 1.15)
    ratio = size / max(h, w)
    pw, ph = max(2, round(w * ratio * stretch)), max(2, round(h * ratio / stretch))
    patch = cv2.resize(crop, (pw, ph), interpolation=cv2.INTER_AREA if ratio < 1 else cv2.INTER_LINEAR)
    patch = patch[:, ::-1] if rng.random() < 0.5 else patch
    return np.clip(patch * np.float32(rng.uniform(0.75, 1.25)), 0, 255).astype(np.uint8)


def covered_share(box, by) -> float:
    """The share of box's area that the box `by` covers (boxes as x0, y0, x1, y1)."""
    w = min(box[2], by[2]) - max(box[0], by[0])
    h = min(box[3], by[3]) - max(box[1], by[1])
    return max(w, 0) * max(h, 0) / ((box[2] - box[0]) * (box[3] - box[1]))


def paste_objects(rng, image, objects, max_objects: int) -> list:
    """Paste 1..max_objects object patches onto image (in place); returns their YOLO labels (class, cx, cy, w, h),
    each box exactly the pasted patch. A placement that would hide too much of an earlier object is tried again."""
    height, width = image.shape[:2]
    boxes = []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        cls = int(rng.integers(len(objects)))
        patch = object_patch(rng, objects[cls], round(rng.uniform(0.12, 0.6) * min(width, height)))
        ph, pw = patch.shape[:2]
        if pw > width or ph > height:
            continue
        for _attempt in range(20):
            x0, y0 = int(rng.integers(0, width - pw + 1)), int(rng.integers(0, height - ph + 1))
            box = (x0, y0, x0 + pw, y0 + ph)
            if all(covered_share(earlier, box) <= MAX_OVERLAP for _, earlier in boxes):
                image[y0:y0 + ph, x0:x0 + pw] = patch
                boxes.append((cls, box))
                break
    return [(cls, (x0 + x1) / 2 / width, (y0 + y1) / 2 / height, (x1 - x0) / width, (y1 - y0) / height)
            for cls, (x0, y0, x1, y1) in boxes]


def compose(rng, sources: Sources, scale: float, max_objects: int):
    """One image (BGR uint8) and its labels."""
    width, height = (max(32, round(side * scale)) for side in SIZES[int(rng.integers(len(SIZES)))])
    image = background(rng, sources.backgrounds[int(rng.integers(len(sources.backgrounds)))], width, height)
    return image, paste_objects(rng, image, sources.objects, max_objects)


# -- what the files cost -----------------------------------------------------------------------------------------------

def file_stats(root: Path, count=200) -> dict:
    """Mean file size and single-thread cv2.imread time of the first `count` training images."""
    files = sorted((Path(root) / 'images' / 'train').glob('*.jpg'))[:count]
    started = time.perf_counter()
    for f in files:
        cv2.imread(str(f))
    seconds = time.perf_counter() - started
    return {'images': len(files), 'mean_kb': round(sum(f.stat().st_size for f in files) / len(files) / 1024, 1),
            'decode_ms_per_image': round(seconds / len(files) * 1000, 2)}


# -- writing the dataset --------------------------------------------------------------------------------------------

SPEC_FILE = 'photo-spec.json'


def write_item(root: Path, spec: PhotoSpec, split: str, index: int):
    image, labels = spec.draw(split, index)
    name = f'{split}_{index:06d}'
    # imencode, not imwrite: upstream's utils.general replaces cv2.imwrite by a function without encoding parameters
    _, encoded = cv2.imencode('.jpg', image, [cv2.IMWRITE_JPEG_QUALITY, spec.jpeg_quality])
    (root / 'images' / split / f'{name}.jpg').write_bytes(encoded.tobytes())
    (root / 'labels' / split / f'{name}.txt').write_text(''.join(
        f'{c} {x:.6f} {y:.6f} {w:.6f} {h:.6f}\n' for c, x, y, w, h in labels))


def write_split(root: Path, spec: PhotoSpec, split: str, count: int, processes: int):
    for folder in ('images', 'labels'):
        (root / folder / split).mkdir(parents=True)
    jobs = [(root, spec, split, index) for index in range(count)]
    write_items(write_item, jobs, processes)


def ensure_photo_dataset(root, spec=PhotoSpec(), log=print, processes=1) -> Path:
    """Return root/data.yaml, generating the dataset first unless root already holds this spec."""
    def write(folder: Path):
        log(f'generating a photo dataset in {root}: {spec}')
        for split, count in (('train', spec.train), ('val', spec.val)):
            write_split(folder, spec, split, count, processes)
        names = ''.join(f'  {i}: {name}\n' for i, name in enumerate(OBJECTS))
        (folder / 'data.yaml').write_text(f'path: {Path(root).resolve()}\ntrain: images/train\nval: images/val\n'
                                          f'names:\n{names}')
    return generated_dataset(root, spec, SPEC_FILE, 'a photo dataset', write)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('root', type=Path, help='folder to create (data.yaml goes inside)')
    parser.add_argument('--processes', type=int, default=os.cpu_count(), help='image writers in parallel')
    for field, default in asdict(PhotoSpec()).items():
        parser.add_argument(f'--{field.replace("_", "-")}', type=type(default), default=default)
    args = parser.parse_args(argv)
    spec = PhotoSpec(**{k: v for k, v in vars(args).items() if k not in ('root', 'processes')})
    print(ensure_photo_dataset(args.root, spec, processes=args.processes))
    print(file_stats(args.root))


if __name__ == '__main__':
    main()
