"""Build step of the kit (the metadata is in pyproject.toml): the wheel also carries patches/ and every file the
applier installs into a YOLOv9 clone (patchkit.pin.INSTALLED), under patchkit/kit/, where an installed applier
finds them."""
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from patchkit.pin import INSTALLED  # noqa: E402  (pin.py needs nothing outside the standard library)


class BuildWithKitFiles(build_py):
    def run(self):
        super().run()
        kit = Path(self.build_lib) / 'patchkit' / 'kit'
        for name in ('patches', *INSTALLED):
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, kit / name, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
            else:
                (kit / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, kit / name)


setup(cmdclass={'build_py': BuildWithKitFiles})
