"""Fixtures shared by the DDP tests (imported by the test modules that use them)."""
import sys

import pytest

from ddp_helpers import run, train_args
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset


@pytest.fixture(scope='session')
def trained_weights(patched_tree, tmp_path_factory):
    """best.pt of a short single-process run: weights that detect something (mAP50 > 0) on the demo data."""
    folder = tmp_path_factory.mktemp('trained')
    data = ensure_demo_dataset(folder / 'demo', DemoSpec(train=128, val=50, imgsz=64))
    args = train_args(data, folder / 'runs', 16, 8, 64)
    result = run([sys.executable, 'ddp_train_dual.py', *map(str, args)], patched_tree, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / 'runs' / 'exp' / 'weights' / 'best.pt'
