"""Pretend, in every Python process that starts with this folder first on PYTHONPATH, an environment that the test
machine does not have; YOLOV9_DDP_PRETEND names what, comma-separated:

  torch=VERSION  torch.__version__ reads VERSION: a torch below the kit's floor, without installing one
  no-opencv      `import cv2` fails with the ModuleNotFoundError of an environment without OpenCV
  old-driver     CUDA cannot start because the NVIDIA driver is older than the torch build needs: as torch does
                 then, torch.cuda.is_available() is False and torch.cuda.init() raises torch's own message
  late-rank-0    the node's first process (LOCAL_RANK 0) starts 3 s after the others: its peers reach the kit's
                 checks first

Only what the kit reads is changed; everything else stays the real installation. Used by tests/test_environment.py
(the machine without a GPU gives the real "no driver" case; these are the cases it cannot give).
"""
import os
import sys
import time

PRETEND = {item.strip() for item in os.environ.get('YOLOV9_DDP_PRETEND', '').split(',') if item.strip()}
# c10/cuda's message for cudaErrorInsufficientDriver, as torch.cuda.init() raises it
OLD_DRIVER = ('The NVIDIA driver on your system is too old (found version 11040). Please update your GPU driver by '
              'downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx '
              'Alternatively, go to: https://pytorch.org to install a PyTorch version that has been compiled with '
              'your version of the CUDA driver.')


class NoOpenCV:
    """A meta path finder that finds cv2 missing, whatever is installed."""

    def find_spec(self, name, path=None, target=None):
        if name == 'cv2' or name.startswith('cv2.'):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return None


def pretend_torch(version=None, old_driver=False):
    import torch
    if version:
        torch.__version__ = torch.torch_version.TorchVersion(version)
    if old_driver:
        def cuda_init():
            raise RuntimeError(OLD_DRIVER)
        torch._C._cuda_init = cuda_init
        torch.cuda.is_available = lambda: False


if 'no-opencv' in PRETEND:
    sys.meta_path.insert(0, NoOpenCV())
versions = [item.split('=', 1)[1] for item in PRETEND if item.startswith('torch=')]
if versions or 'old-driver' in PRETEND:
    pretend_torch(versions[0] if versions else None, 'old-driver' in PRETEND)
if 'late-rank-0' in PRETEND and os.environ.get('LOCAL_RANK') == '0':
    time.sleep(3)
