#!/usr/bin/env bash
# tools/make-venv.sh VENV CONSTRAINTS [REQUIREMENTS-FILE...]
# Create VENV if needed and install requirements.txt (and the given requirement files) at the exact versions of
# CONSTRAINTS (constraints/newest.txt or constraints/oldest.txt), then an OpenCV where none imports: OpenCV is the
# user's choice and not in requirements.txt (docs/clone.md, "Your Python environment"); the kit's own venvs take
# opencv-python-headless at the version CONSTRAINTS pins. Used by run-tests.sh, run-demo.sh and .ci/run.
#
# pip installs uv into VENV (at the version CONSTRAINTS pins), and uv installs the rest: it downloads and unpacks
# the CUDA build's 6 GB of wheels in parallel. It compiles the bytecode, as pip does: where PYTHONDONTWRITEBYTECODE
# is set, nothing else would, and every new interpreter would compile torch's sources again. uv keeps the wheels in
# its cache (~/.cache/uv; `uv cache clean` reclaims the space), whatever a proxy does to HTTP caching, so that a
# rerun or another venv of the same versions installs without downloading. Under CI (CI set, a fresh machine that
# builds each venv once) nothing is kept: the two CUDA venvs need their 12 GB and not twice that on a shared disk.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$1
constraints=$2
shift 2
requirements=(-r requirements.txt)
for file in "$@"; do
    requirements+=(-r "$file")
done
started=$SECONDS
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir -c "$constraints" uv
install=("$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" -c "$constraints")
[ -z "${CI:-}" ] || install+=(--no-cache)
"${install[@]}" "${requirements[@]}"
"$venv/bin/python" -c 'import cv2' 2>/dev/null || "${install[@]}" opencv-python-headless
versions=$("$venv/bin/python" -c 'import torch, numpy; print("torch", torch.__version__, "numpy", numpy.__version__)')
echo "$venv: $versions, ready in $((SECONDS - started)) s" >&2
