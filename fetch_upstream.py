#!/usr/bin/env python3
"""Put the pinned YOLOv9 upstream into a new folder, verified file by file against patches/UPSTREAM.

  python fetch_upstream.py DEST                  git checkout of the pin; without network access to
                                                 GitHub, a rebuild from two PyPI wheels instead
  python fetch_upstream.py DEST --source pypi    only the rebuild (needs PyPI, or --wheels)
  python fetch_upstream.py DEST --wheels DIR     take the wheels from DIR (downloaded there if missing)

The output says which source was used. A rebuilt tree is byte-identical to the pin in every file it
has; it lacks a few files the wheels do not carry (README.md, images, a notebook, a shell script).
"""
import argparse
import sys
from pathlib import Path

from patchkit.pin import PinError, read_pin
from patchkit.upstream import UpstreamError, provide_upstream


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], epilog=__doc__.split('\n\n', 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('dest', type=Path, help='folder to create')
    parser.add_argument('--source', choices=('auto', 'git', 'pypi'), default='auto',
                        help='where to get the tree from (default: git, falling back to pypi)')
    parser.add_argument('--wheels', type=Path, help='folder for the PyPI wheels (default: the user cache)')
    args = parser.parse_args(argv)
    try:
        provide_upstream(read_pin(), args.dest, args.source, args.wheels)
    except (UpstreamError, PinError) as e:
        print(f'fetch_upstream.py: error: {e}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
