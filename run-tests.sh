#!/usr/bin/env bash
# Set up .venv (requirements.txt and requirements-test.txt at the exact versions of constraints/newest.txt) and run
# the whole test suite, offline-capable: the pinned upstream is rebuilt from PyPI wheels (or taken from
# $YOLOV9_UPSTREAM) and cached in ~/.cache/yolov9-ddp. Arguments go to pytest (e.g. -m smoke, -k NAME).
set -euo pipefail
cd "$(dirname "$0")"
tools/make-venv.sh .venv constraints/newest.txt requirements-test.txt
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests "$@"  # modules in conftest's order
