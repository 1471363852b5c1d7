#!/usr/bin/env python3
"""Build the two trees bench/run_bench.py compares, into DEST (default .bench, git-ignored):

  DEST/upstream   the pinned YOLOv9 with the modern-stack patches 0001-0008 only: upstream's own training code,
                  able to run on today's torch / numpy / setuptools / Pillow
  DEST/kit        the pinned YOLOv9 with the whole series applied and the kit installed (apply_patches.py)

The GPU machine has no package registry, so the trees are made here and travel with the working tree.
"""
import shutil
import subprocess
import sys
from pathlib import Path

KIT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(KIT))

from patchkit.gitapply import git_apply  # noqa: E402
from patchkit.pin import read_pin  # noqa: E402
from patchkit.series import read_series  # noqa: E402
from patchkit.upstream import default_cache_dir, provide_upstream  # noqa: E402

MODERN_STACK = 8  # patches 0001-0008; 0009 and 0010 are the kit's DDP pieces


def main():
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else KIT / '.bench')
    shutil.rmtree(dest, ignore_errors=True)
    pinned = dest / 'pinned'
    provide_upstream(read_pin(), pinned, source='pypi', wheel_dir=default_cache_dir() / 'wheels')
    shutil.copytree(pinned, dest / 'upstream')
    result = git_apply(dest / 'upstream', [p.path for p in read_series()[:MODERN_STACK]])
    assert result.ok, result.output
    shutil.copytree(pinned, dest / 'kit')
    subprocess.run([sys.executable, str(KIT / 'apply_patches.py'), str(dest / 'kit')], check=True)
    shutil.rmtree(pinned)


if __name__ == '__main__':
    main()
