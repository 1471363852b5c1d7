#!/usr/bin/env bash
# tools/make-venv.sh VENV CONSTRAINTS [REQUIREMENTS-FILE...]
# Create VENV if needed and install requirements.txt (and the given requirement files) at the exact versions of
# CONSTRAINTS (constraints/newest.txt or constraints/oldest.txt), then an OpenCV where none imports: OpenCV is the
# user's choice and not in requirements.txt (docs/clone.md, "Your Python environment"); the kit's own venvs take
# opencv-python-headless at the version CONSTRAINTS pins. Used by run-tests.sh, run-demo.sh and .ci/run.
#
# The wheels are kept in ~/.cache/pip/yolov9-ddp/NAME (NAME: the constraints file's; delete it to reclaim the
# space), downloaded once per version of the files, so that a rerun installs without downloading. pip's own HTTP
# cache is not enough: it keeps only responses that allow caching, and where the registry is reached through a
# proxy that drops those headers it keeps nothing, and every new venv downloads torch 2.4's 3 GB of wheels again.
# pip's HTTP cache is left out (--no-cache-dir): beside the kept wheels it would be a second copy of them.
# Under CI (CI set, a fresh machine that builds each venv once) nothing is kept: pip installs from the registries
# straight into the venv, so that the two CUDA venvs need their 12 GB installed and not twice that on a shared disk.
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
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-cache-dir)
if [ -n "${CI:-}" ]; then
    install=("${pip[@]}" install --quiet -c "$constraints")
else
    wheels=${XDG_CACHE_HOME:-$HOME/.cache}/pip/yolov9-ddp/$(basename "$constraints" .txt)
    stamp=$(cat "$constraints" requirements.txt "$@" | sha256sum | cut -c1-16)
    if [ ! -f "$wheels/.complete-$stamp" ]; then
        "${pip[@]}" download --quiet --dest "$wheels" -c "$constraints" "${requirements[@]}" opencv-python-headless
        touch "$wheels/.complete-$stamp"
    fi
    install=("${pip[@]}" install --quiet --no-index --find-links "$wheels" -c "$constraints")
fi
"${install[@]}" "${requirements[@]}"
"$venv/bin/python" -c 'import cv2' 2>/dev/null || "${install[@]}" opencv-python-headless
versions=$("$venv/bin/python" -c 'import torch, numpy; print("torch", torch.__version__, "numpy", numpy.__version__)')
echo "$venv: $versions, ready in $((SECONDS - started)) s" >&2
