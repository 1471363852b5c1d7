"""ddp_train_dual.py (through faulty_train.py: its FAULT applies too), recording the samples each rank trains: the
key (epoch, index) of every training sample loaded and the image upstream's dataset loads for it (its `indices`:
--image-weights' draw, else the index itself), one line each, `epoch index image`, appended to
$RECORD_DIR/rank{RANK}-{pid}.txt. With --workers 0 a sample is loaded in the training process when its batch is
next, so what is loaded is what is trained: a stop comes after a step.

    RECORD_DIR=/tmp/rec torchrun ... testsupport/probes/recording_train.py TRAIN_ARGS...   (in the patched tree)
"""
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the patched tree: the kit's yolov9_ddp as installed there

from yolov9_ddp import stream  # noqa: E402

loaded = stream.SeededSamples.__getitem__


def recording(self, key):
    folder = Path(os.environ['RECORD_DIR'])
    with open(folder / f'rank{os.environ.get("RANK", 0)}-{os.getpid()}.txt', 'a') as f:
        f.write(f'{key[0]} {key[1]} {self.dataset.indices[key[1]]}\n')
    return loaded(self, key)


stream.SeededSamples.__getitem__ = recording
sys.argv = [str(Path(__file__).with_name('faulty_train.py')), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name='__main__')
