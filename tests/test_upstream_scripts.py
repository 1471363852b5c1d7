"""Every upstream training script, and what users run after it, in the patched tree on today's stack, offline.

For train.py, train_dual.py, train_triple.py, segment/train.py, segment/train_dual.py, panoptic/train.py and
classify/train.py: one epoch on CPU on tiny generated data, fine-tuning an untrained checkpoint (--weights: the
path from scratch and the loading of weights in one run), a --resume of it as if interrupted after that epoch
(detection, segmentation, panoptic), then the script's val and predict counterparts on the best.pt it saved. Then
export.py (TorchScript, run again by detect.py) and hubconf.py (a local .pt through custom()), on train.py's run.
Each run must end with exit status 0, without a traceback, a deprecated torch.cuda.amp call, a download or a pip
install (the network is blocked; patches 0001-0013 make this possible).

The models are the kit's tiny configs (yolov9_ddp/models), one per head; the data come from
yolov9_ddp.demo_data with the labels each task reads.
"""
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from testsupport.faults import results_epochs
from testsupport.trees import MODELS, describe, offline_environment, run_command, run_python
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset

pytestmark = pytest.mark.timeout(1200)

RUN_TIMEOUT_S = 600
TRAIN_IMAGES, VAL_IMAGES, IMGSZ = 16, 8, 64
HYP = 'data/hyps/hyp.scratch-high.yaml'  # segment/ and panoptic/ default to hyp.scratch-low.yaml, which upstream lacks


@dataclass(frozen=True)
class Task:
    train: str  # the training script
    cfg: str  # the kit's tiny model config
    labels: str  # DemoSpec.labels of its dataset
    val: str
    predict: str
    resumes: bool = True


TASKS = {
    'detect': Task('train.py', 'tiny.yaml', 'boxes', 'val.py', 'detect.py'),
    'dual': Task('train_dual.py', 'tiny-dual.yaml', 'boxes', 'val_dual.py', 'detect_dual.py'),
    'triple': Task('train_triple.py', 'tiny-triple.yaml', 'boxes', 'val_triple.py', 'detect.py'),
    'segment': Task('segment/train.py', 'tiny-seg.yaml', 'polygons', 'segment/val.py', 'segment/predict.py'),
    'segment-dual': Task('segment/train_dual.py', 'tiny-seg-dual.yaml', 'polygons', 'segment/val_dual.py',
                         'segment/predict.py'),
    'panoptic': Task('panoptic/train.py', 'tiny-panoptic.yaml', 'panoptic', 'panoptic/val.py', 'panoptic/predict.py'),
    'classify': Task('classify/train.py', 'tiny.yaml', 'classes', 'classify/val.py', 'classify/predict.py',
                     resumes=False),
}


@pytest.fixture(scope='module')
def env(tmp_path_factory) -> dict:
    return offline_environment(tmp_path_factory.mktemp('home'))


@pytest.fixture(scope='module')
def datasets(tmp_path_factory):
    """datasets(labels): data.yaml of a 16 + 8 image dataset at 64 px with those labels (built once)."""
    root = tmp_path_factory.mktemp('data')

    def dataset(labels: str) -> Path:
        spec = DemoSpec(train=TRAIN_IMAGES, val=VAL_IMAGES, imgsz=IMGSZ, labels=labels)
        return ensure_demo_dataset(root / labels, spec, log=lambda msg: None)

    return dataset


def run_script(tree: Path, env: dict, script: str, *args) -> subprocess.CompletedProcess:
    result = run_command([sys.executable, script, *args], tree, env, RUN_TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and 'Traceback' not in output, f'{script} failed:\n{describe(result)}'
    for fault in ('torch.cuda.amp', 'attempting AutoUpdate', 'Downloading'):
        assert fault not in output, f'{script}: {fault!r} in its output:\n{describe(result)}'
    return result


def assert_validated(result: subprocess.CompletedProcess, images: int):
    """The summary row of a validation: 'all', the number of images, ..."""
    rows = [line.split() for line in (result.stdout + result.stderr).splitlines() if line.split()[:1] == ['all']]
    assert rows and all(row[1] == str(images) for row in rows), describe(result)


def train_args(task: Task, data: Path, project: Path, name: str, weights, *extra) -> list:
    common = ['--epochs', 1, '--batch-size', 8, '--imgsz', IMGSZ, '--device', 'cpu', '--workers', 0,
              '--project', project, '--name', name, *extra]
    if task.labels == 'classes':  # classify/train.py: a folder of class folders, a model instead of a config
        return ['--data', data.parent, '--model', weights, '--pretrained', 'False', *common]
    return ['--data', data, '--cfg', MODELS / task.cfg, '--hyp', HYP, '--weights', weights, '--noplots', *common]


# An untrained checkpoint of each task's tiny model, as upstream's released weights are saved ({'model': Model}), all
# made in one process. For classify/train.py, which takes no config, the tiny detector: it cuts that into a backbone
# and a Classify head as it does upstream's detection checkpoints.
UNTRAINED_PT = '''
import sys, torch
from models.yolo import Model
for cfg, path, classes in zip(*[iter(sys.argv[1:])] * 3):
    torch.save({'model': Model(cfg, ch=3, nc=int(classes))}, path)
'''


@pytest.fixture(scope='module')
def untrained(patched_tree, datasets, env, tmp_path_factory) -> dict:
    """{task name: an untrained checkpoint of its tiny model with its dataset's classes}."""
    folder = tmp_path_factory.mktemp('untrained')
    weights, args = {}, []
    for name, task in TASKS.items():
        data = datasets(task.labels)
        classes = 3 if task.labels == 'classes' else len(yaml.safe_load(data.read_text())['names'])
        weights[name] = folder / f'{name}.pt'
        args += [MODELS / task.cfg, weights[name], classes]
    result = run_python(UNTRAINED_PT, patched_tree, env, args=args)
    assert result.returncode == 0, describe(result)
    return weights


def interrupted_after_the_first_epoch(run: Path) -> Path:
    """The run's epoch0.pt (--save-period 1), as a 2-epoch run stopped after its first epoch leaves it."""
    options = run / 'opt.yaml'
    options.write_text(options.read_text().replace('\nepochs: 1\n', '\nepochs: 2\n'))
    return run / 'weights' / 'epoch0.pt'


@pytest.fixture(scope='module')
def trained(patched_tree, datasets, env, untrained, tmp_path_factory):
    """trained(name): the folder of the task's training run (PROJECT/exp), resumed where the task resumes; once."""
    projects = {}

    def train(name: str) -> Path:
        if name not in projects:
            task, project = TASKS[name], tmp_path_factory.mktemp(name)
            data = datasets(task.labels)
            resumable = ['--save-period', 1] if task.resumes else []
            run_script(patched_tree, env, task.train,
                       *train_args(task, data, project, 'exp', untrained[name], *resumable))
            if task.resumes:
                before = results_epochs(project / 'exp')
                run_script(patched_tree, env, task.train, '--resume',
                           interrupted_after_the_first_epoch(project / 'exp'))
                assert results_epochs(project / 'exp')[len(before)] == 1, 'the resumed run did not continue at epoch 1'
            projects[name] = project
        return projects[name] / 'exp'
    return train


def test_every_script_and_model_of_the_tasks_exists(pinned_upstream):
    for task in TASKS.values():
        for script in (task.train, task.val, task.predict):
            assert (pinned_upstream / script).is_file(), script
        assert (MODELS / task.cfg).is_file(), task.cfg
    assert (pinned_upstream / HYP).is_file()


@pytest.mark.parametrize('name', TASKS)
@pytest.mark.slow
@pytest.mark.one_core
def test_train_fine_tune_resume_validate_and_predict_offline(name, patched_tree, datasets, trained, env, tmp_path):
    task, run = TASKS[name], trained(name)
    data, project = datasets(task.labels), tmp_path / 'runs'
    images = data.parent / ('val' if task.labels == 'classes' else 'images/val')
    best = run / 'weights' / 'best.pt'
    assert best.is_file() and (run / 'weights' / 'last.pt').is_file()

    validation = ['--data', data.parent if task.labels == 'classes' else data, '--weights', best, '--batch-size', 8,
                  '--imgsz', IMGSZ, '--device', 'cpu', '--workers', 0, '--project', project, '--name', 'val']
    assert_validated(run_script(patched_tree, env, task.val, *validation), VAL_IMAGES)

    source = next(images.iterdir()) if task.labels == 'classes' else images
    run_script(patched_tree, env, task.predict, '--source', source, '--weights', best, '--imgsz', IMGSZ,
               '--device', 'cpu', '--project', project, '--name', 'predict')
    predicted = list((project / 'predict').glob('*.jpg'))
    assert len(predicted) == len(list(source.glob('*.jpg'))), f'{task.predict} saved {predicted}'
    assert not list(Path(env['YOLOV5_CONFIG_DIR']).iterdir()), 'something was downloaded into the settings folder'


@pytest.fixture(scope='module')
def detector(trained) -> Path:
    """best.pt of train.py's run with the kit's tiny single-head model."""
    return trained('detect') / 'weights' / 'best.pt'


@pytest.mark.slow
@pytest.mark.one_core
def test_export_to_torchscript_and_detect_with_it(patched_tree, detector, datasets, env, tmp_path):
    run_script(patched_tree, env, 'export.py', '--weights', detector, '--include', 'torchscript', '--imgsz', IMGSZ,
               '--device', 'cpu')
    exported = detector.with_suffix('.torchscript')
    assert exported.is_file()
    images = datasets('boxes').parent / 'images' / 'val'
    run_script(patched_tree, env, 'detect.py', '--source', images, '--weights', exported, '--imgsz', IMGSZ,
               '--device', 'cpu', '--project', tmp_path, '--name', 'detect')
    assert len(list((tmp_path / 'detect').glob('*.jpg'))) == VAL_IMAGES


HUB_CUSTOM = '''
import sys
import numpy as np
import hubconf
model = hubconf.custom(path=sys.argv[1], autoshape=True, _verbose=False, device='cpu')
results = model([np.zeros((64, 64, 3), np.uint8)] * 2, size=64)
print(type(model).__name__, len(results.pred))
'''


@pytest.mark.slow
@pytest.mark.one_core
def test_hubconf_loads_a_local_checkpoint(patched_tree, detector, env):
    result = run_python(HUB_CUSTOM, patched_tree, env, args=[detector])
    assert result.returncode == 0 and result.stdout.split()[-2:] == ['AutoShape', '2'], describe(result)
    assert 'attempting AutoUpdate' not in result.stdout + result.stderr, describe(result)
