"""The benchmarks' photo dataset (bench/photo_data.py): boxes are exactly where the objects were pasted, images are
a pure function of their seed, and the files come out in YOLO format. Drawn here from synthetic sources: the real
ones are scikit-image's sample photographs, which the kit's tests do not need."""
import cv2
import numpy as np
import pytest
import yaml

from bench import photo_data
from bench.photo_data import MAX_OVERLAP, OBJECTS, SIZES, PhotoSpec, Sources, compose, covered_share, paste_objects
from yolov9_ddp.demo_data import generated_dataset

CLASS_COLOURS = [(200, 0, 0), (0, 200, 0), (0, 0, 200), (200, 200, 0), (0, 200, 200)]  # told apart by their zeros


def synthetic_sources() -> Sources:
    objects = tuple(np.full((40 + 10 * i, 25 + 5 * i, 3), colour, np.uint8) for i, colour in enumerate(CLASS_COLOURS))
    backgrounds = (np.full((100, 120), 90, np.uint8), np.full((90, 70, 3), 60, np.uint8))
    return Sources(objects, backgrounds)


def pixel_boxes(labels, width, height) -> list:
    return [(cls, (round((cx - w / 2) * width), round((cy - h / 2) * height),
                   round((cx + w / 2) * width), round((cy + h / 2) * height))) for cls, cx, cy, w, h in labels]


@pytest.mark.parametrize('seed', range(5))
def test_each_box_is_exactly_the_patch_pasted_for_its_class(seed):
    image = np.zeros((480, 640, 3), np.uint8)
    labels = paste_objects(np.random.default_rng(seed), image, synthetic_sources().objects, max_objects=8)
    assert 1 <= len(labels) <= 8
    boxes = pixel_boxes(labels, 640, 480)
    painted = np.zeros((480, 640), bool)
    for _, (x0, y0, x1, y1) in boxes:
        assert 0 <= x0 < x1 <= 640 and 0 <= y0 < y1 <= 480
        painted[y0:y1, x0:x1] = True
    assert np.array_equal(painted, image.any(axis=2)), 'pixels pasted outside the boxes, or boxes not pasted'
    for i, (cls, (x0, y0, x1, y1)) in enumerate(boxes):
        visible = np.ones((y1 - y0, x1 - x0), bool)
        for _, (a0, b0, a1, b1) in boxes[i + 1:]:  # later patches may cover part of this one
            assert covered_share((x0, y0, x1, y1), (a0, b0, a1, b1)) <= MAX_OVERLAP + 1e-9
            visible[max(b0 - y0, 0):max(b1 - y0, 0), max(a0 - x0, 0):max(a1 - x0, 0)] = False
        seen = image[y0:y1, x0:x1][visible]
        assert len(seen) and np.array_equal(seen.any(axis=0), np.array(CLASS_COLOURS[cls]) > 0), \
            f'box {i} of class {cls} shows another class'


def test_an_image_is_a_pure_function_of_its_seed_at_a_coco_size():
    sources = synthetic_sources()
    first, labels = compose(np.random.default_rng(7), sources, 1.0, 8)
    again, labels_again = compose(np.random.default_rng(7), sources, 1.0, 8)
    assert np.array_equal(first, again) and labels == labels_again
    assert (first.shape[1], first.shape[0]) in SIZES and first.dtype == np.uint8 and first.shape[2] == 3
    assert all(0 < v <= 1 for _, *box in labels for v in box)
    other, _ = compose(np.random.default_rng(8), sources, 1.0, 8)
    assert other.shape != first.shape or not np.array_equal(other, first)


def test_scale_shrinks_the_image_sizes():
    image, _ = compose(np.random.default_rng(3), synthetic_sources(), 0.5, 4)
    assert (image.shape[1] * 2, image.shape[0] * 2) in {(2 * round(w / 2), 2 * round(h / 2)) for w, h in SIZES}


def test_the_dataset_is_written_in_yolo_format(tmp_path, monkeypatch):
    monkeypatch.setattr(photo_data, 'photo_sources', synthetic_sources)
    spec = PhotoSpec(train=4, val=2, max_objects=3)
    data_yaml = photo_data.ensure_photo_dataset(tmp_path / 'photos', spec, log=lambda msg: None)
    assert yaml.safe_load(data_yaml.read_text())['names'] == dict(enumerate(OBJECTS))
    for split, count in (('train', 4), ('val', 2)):
        for index in range(count):
            stem = f'{split}_{index:06d}'
            image = cv2.imread(str(tmp_path / 'photos' / 'images' / split / f'{stem}.jpg'))
            expected_image, expected_labels = spec.draw(split, index)
            assert image.shape == expected_image.shape
            rows = (tmp_path / 'photos' / 'labels' / split / f'{stem}.txt').read_text().splitlines()
            assert [[float(v) for v in row.split()] for row in rows] == \
                [pytest.approx([c, *box], abs=1e-6) for c, *box in expected_labels]
    assert photo_data.ensure_photo_dataset(tmp_path / 'photos', spec, log=pytest.fail) == data_yaml  # kept


def test_the_writer_works_where_upstream_replaced_cv2_imwrite(tmp_path, monkeypatch):
    """Upstream's utils.general redefines cv2.imwrite(path, im) without encoding parameters; the trainer imports it
    before it generates the demo dataset."""
    monkeypatch.setattr(cv2, 'imwrite', lambda path, im: pytest.fail('cv2.imwrite called'))
    monkeypatch.setattr(photo_data, 'photo_sources', synthetic_sources)
    data_yaml = photo_data.ensure_photo_dataset(tmp_path / 'photos', PhotoSpec(train=2, val=1), log=lambda msg: None)
    assert cv2.imdecode(np.fromfile(data_yaml.parent / 'images' / 'val' / 'val_000000.jpg', np.uint8), 1) is not None


def test_a_generated_dataset_replaces_its_folder_whole_or_not_at_all(tmp_path):
    """yolov9_ddp.demo_data.generated_dataset, which both generators use: a foreign folder is refused, a writer that
    fails leaves the previous dataset as it was, and another spec replaces it whole."""
    root, old, new = tmp_path / 'data', PhotoSpec(train=1, val=1), PhotoSpec(train=2, val=1)

    def writer(marker):
        return lambda folder: (folder / 'data.yaml').write_text(marker)

    (tmp_path / 'foreign').mkdir()
    (tmp_path / 'foreign' / 'x.txt').write_text('mine')
    with pytest.raises(FileExistsError, match='is not a photo dataset'):
        generated_dataset(tmp_path / 'foreign', old, 'spec.json', 'a photo dataset', writer('old'))
    assert generated_dataset(root, old, 'spec.json', 'a photo dataset', writer('old')).read_text() == 'old'

    def failing(folder):
        (folder / 'data.yaml').write_text('half')
        raise OSError('disk full')
    with pytest.raises(OSError):
        generated_dataset(root, new, 'spec.json', 'a photo dataset', failing)
    assert (root / 'data.yaml').read_text() == 'old'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['data', 'foreign']  # no scratch folder left
    assert generated_dataset(root, new, 'spec.json', 'a photo dataset', writer('new')).read_text() == 'new'
    assert sorted(p.name for p in root.iterdir()) == ['data.yaml', 'spec.json']
