#!/usr/bin/env python3
"""The two trees the benchmarks compare, built from what travels with the working tree:

  TREES/upstream   the pinned YOLOv9 with the modern-stack patches 0001-0008 only: upstream's own training code,
                   able to run on today's torch / numpy / setuptools / Pillow
  TREES/kit        the pinned YOLOv9 with the whole series applied and this working tree's kit installed

    python bench/prepare_trees.py pack [CARRY]     here, with network or a filled cache: CARRY (default .bench, an
                                                   ignored folder the device call carries) gets the wheels a build
                                                   needs, and trees built here for a machine without git
    python bench/prepare_trees.py build TREES [--carry CARRY]   on the GPU machine (no network): the trees, rebuilt
                                                   from the carried wheels unless TREES already holds this kit's

The GPU machine has no package registry: the pinned upstream is rebuilt from the two PyPI wheels that carry its
files (fetch_upstream.py --source pypi). Without git there, the trees packed here are used, provided they were
built from the same patches and kit files (their stamp says so).
"""
import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

KIT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(KIT))

MODERN_STACK = 8  # patches 0001-0008: what upstream's own train_dual.py needs on today's stack; the rest serve the kit
STAMP = 'STAMP'


def kit_stamp() -> str:
    """sha256 over the patches and the kit files a tree gets: equal stamps, equal trees."""
    from patchkit.pin import kit_files
    patches = {p.relative_to(KIT).as_posix(): p.read_bytes() for p in (KIT / 'patches').rglob('*') if p.is_file()}
    digest = hashlib.sha256()
    for name, data in sorted({**patches, **kit_files()}.items()):
        digest.update(name.encode())
        digest.update(data)
    return digest.hexdigest()


def build(trees: Path, upstream_wheels: Path):
    """trees/upstream and trees/kit from the pinned upstream rebuilt out of the wheels; trees/STAMP last."""
    from patchkit.pin import read_pin
    from patchkit.upstream import provide_upstream
    from testsupport.trees import PATCHES, SERIES, git_apply
    shutil.rmtree(trees, ignore_errors=True)
    pinned = trees / 'pinned'
    provide_upstream(read_pin(), pinned, source='pypi', wheel_dir=upstream_wheels)
    shutil.copytree(pinned, trees / 'upstream')
    result = git_apply(trees / 'upstream', [PATCHES / name for name in SERIES[:MODERN_STACK]])
    if result.returncode:
        raise SystemExit(f'prepare_trees.py: the modern-stack patches do not apply: {result.stderr.strip()}')
    shutil.copytree(pinned, trees / 'kit')
    subprocess.run([sys.executable, str(KIT / 'apply_patches.py'), str(trees / 'kit')], check=True,
                   stdout=subprocess.DEVNULL)
    shutil.rmtree(pinned)
    (trees / STAMP).write_text(kit_stamp())


def current(trees: Path) -> bool:
    return (trees / STAMP).is_file() and (trees / STAMP).read_text() == kit_stamp()


def can_build() -> bool:
    return shutil.which('git') is not None


def pack(carry: Path):
    """carry/upstream-wheels and carry/trees (for a machine without git)."""
    from patchkit.upstream import default_cache_dir, download_wheels
    for path in download_wheels(default_cache_dir() / 'wheels').values():
        (carry / 'upstream-wheels').mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, carry / 'upstream-wheels' / path.name)
    build(carry / 'trees', carry / 'upstream-wheels')
    print(f'{carry}: {sum(f.stat().st_size for f in carry.rglob("*") if f.is_file()) / 2 ** 20:.1f} MiB to carry')


def ensure_trees(trees: Path, carry: Path, log=print) -> Path:
    """trees holding this kit's two trees: kept if current, else built here, else copied from carry/trees."""
    if current(trees):
        log(f'trees: {trees} (current)')
    elif can_build():
        build(trees, carry / 'upstream-wheels')
        log(f'trees: built in {trees} from the wheels in {carry}')
    elif current(carry / 'trees'):
        shutil.rmtree(trees, ignore_errors=True)
        shutil.copytree(carry / 'trees', trees)
        log(f'trees: no git here; copied the trees packed in {carry}')
    else:
        raise SystemExit(f'prepare_trees.py: git is missing here and {carry}/trees is not built from '
                         f'this kit; run `python bench/prepare_trees.py pack` where the kit is and carry {carry}')
    return trees


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest='command', required=True)
    sub.add_parser('pack').add_argument('carry', type=Path, nargs='?', default=KIT / '.bench')
    b = sub.add_parser('build')
    b.add_argument('trees', type=Path)
    b.add_argument('--carry', type=Path, default=KIT / '.bench')
    args = p.parse_args()
    if args.command == 'pack':
        pack(args.carry.resolve())
    else:
        ensure_trees(args.trees.resolve(), args.carry.resolve())


if __name__ == '__main__':
    main()
