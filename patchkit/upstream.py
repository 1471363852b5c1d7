"""Put the pinned upstream tree into a folder: a git checkout of the pin, or a rebuild from PyPI wheels.

Either way every file is checked against the blob ids of patches/UPSTREAM before the folder is
handed over, so a rebuilt tree is byte-identical to the pinned commit wherever it has a file.

The rebuild uses two wheels that carry copies of upstream:
yolov9py (every .py file of an earlier commit, with module names prefixed by `yolov9.`) and
yolo9 (the model and data .yaml files). The few known differences between those copies and the
pin are undone by the small, named repairs below; the blob check proves each repair right.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from patchkit.gitcmd import write_contents
from patchkit.pin import Pin, blob_id, file_blob_id

WHEELS = {'yolov9py': ('yolov9py', '1.1.0', 'yolov9/'), 'yolo9': ('yolo9', '1.0.18', 'yolo9/')}
GIT_TIMEOUT_S = 120

# yolov9py rewrote `import utils` as `import yolov9.utils` (in comments too); this undoes it.
MODULE_PREFIX = re.compile(rb'yolov9\.(classify|export|models|panoptic|segment|utils|val)\b')


class UpstreamError(Exception):
    """The pinned upstream could not be provided."""


def _add_elan1_class(data: bytes, wheels) -> bytes:
    # The pin adds class ELAN1 to models/common.py after yolov9py's source commit; yolo9 carries it verbatim.
    donor = wheels['yolo9'].get('models/common.py', b'')
    start, end = donor.find(b'class ELAN1('), donor.find(b'class RepNCSPELAN4(')
    anchor = data.find(b'class RepNCSPELAN4(')
    if min(start, end, anchor) < 0 or end < start:
        return data
    return data[:anchor] + donor[start:end] + data[anchor:]


def _add_elan1_to_parse_model(data: bytes, wheels) -> bytes:
    # ...and lists it among the modules parse_model() sizes by channel.
    return re.sub(rb'(\n\s+)(RepNCSPELAN4, SPPELAN\}:)', rb'\1ELAN1, \2', data, count=1)


def _drop_train_gc_calls(data: bytes, wheels) -> bytes:
    # yolov9py added `import gc` and an empty_cache()/gc.collect() pair to train.py.
    data = data.replace(b'import gc\n', b'', 1)
    return re.sub(rb'\n[ \t]+torch\.cuda\.empty_cache\(\)\n[ \t]+gc\.collect\(\)(?=\n)', b'', data, count=1)


def _plain_export_import(data: bytes, wheels) -> bytes:
    # The prefix rewrite left `import export as export` in benchmarks.py.
    return data.replace(b'import export as export\n', b'import export\n', 1)


REPAIRS = {
    'models/common.py': _add_elan1_class,
    'models/yolo.py': _add_elan1_to_parse_model,
    'train.py': _drop_train_gc_calls,
    'benchmarks.py': _plain_export_import,
}


def download_wheels(dest: Path, log=print) -> dict:
    """Download the two wheels (without installing them) and return {name: wheel path}."""
    dest.mkdir(parents=True, exist_ok=True)
    found = {}
    for key, (name, version, _) in WHEELS.items():
        pattern = f'{name}-{version}-*.whl'
        if not any(dest.glob(pattern)):
            log(f'downloading {name}=={version} from PyPI')
            cmd = [sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps', '--only-binary', ':all:',
                   f'{name}=={version}', '-d', str(dest)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode or not any(dest.glob(pattern)):
                detail = (result.stderr.strip().splitlines() or ['no wheel found'])[-1]
                raise UpstreamError(f'cannot download {name}=={version} from PyPI: {detail}')
        found[key] = min(dest.glob(pattern))
    return found


def _read_wheel(wheel: Path, package_dir: str) -> dict:
    with zipfile.ZipFile(wheel) as z:
        return {n[len(package_dir):]: z.read(n) for n in z.namelist()
                if n.startswith(package_dir) and not n.endswith('/')}


def rebuild_from_wheels(pin: Pin, dest: Path, wheel_dir: Path, log=print) -> list:
    """Write every pinned file the wheels can provide into dest, each checked by blob id.

    Returns the pinned paths the wheels do not carry (images, a notebook, a shell script).
    """
    paths = download_wheels(wheel_dir, log)
    wheels = {key: _read_wheel(paths[key], WHEELS[key][2]) for key in WHEELS}
    copies = {path: _wheel_copy_of(path, expected, wheels) for path, expected in sorted(pin.all_blobs.items())}
    write_contents(dest, copies)
    return [path for path, data in copies.items() if data is None]


def _wheel_copy_of(path: str, expected: str, wheels):
    """The bytes of the pinned file, from whichever wheel holds a copy that verifies, or None."""
    repair = REPAIRS.get(path, lambda data, _: data)
    for data in filter(None, (wheels[key].get(path) for key in WHEELS)):
        for candidate in (MODULE_PREFIX.sub(rb'\1', data), data):
            for attempt in (candidate, repair(candidate, wheels)):
                if blob_id(attempt) == expected:
                    return attempt
    return None


def clone_pin(pin: Pin, dest: Path, log=print):
    """Check out the pinned commit into dest with git (needs network access to the repository)."""
    env = {**os.environ, 'GIT_TERMINAL_PROMPT': '0'}
    steps = [['git', 'init', '--quiet', str(dest)],
             ['git', '-C', str(dest), 'fetch', '--quiet', '--depth', '1', pin.repository, pin.commit],
             ['git', '-C', str(dest), 'checkout', '--quiet', 'FETCH_HEAD']]
    log(f'fetching {pin.repository} at {pin.short} with git')
    for step in steps:
        try:
            result = subprocess.run(step, capture_output=True, text=True, env=env, timeout=GIT_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise UpstreamError(f'git timed out after {GIT_TIMEOUT_S}s') from e
        if result.returncode:
            detail = (result.stderr.strip().splitlines() or ['failed'])[-1]
            raise UpstreamError(f'git {step[3] if step[1] == "-C" else step[1]}: {detail}')


def provide_upstream(pin: Pin, dest: Path, source='auto', wheel_dir: Path = None, log=print) -> str:
    """Create dest holding the verified pinned tree; returns the source used ('git' or 'pypi').

    dest must not exist yet. The tree is built in a sibling temporary folder and moved into place
    only once verified, so a failure leaves nothing behind.
    """
    dest = Path(dest)
    if dest.exists():
        raise UpstreamError(f'{dest} already exists; give a new folder')
    dest.parent.mkdir(parents=True, exist_ok=True)
    wheel_dir = Path(wheel_dir) if wheel_dir else default_cache_dir() / 'wheels'
    order = {'auto': ['git', 'pypi'], 'git': ['git'], 'pypi': ['pypi']}[source]
    failures = []
    for kind in order:
        work = Path(tempfile.mkdtemp(prefix=f'.{dest.name}.', dir=dest.parent))
        try:
            if kind == 'git':
                clone_pin(pin, work, log)
                unavailable = []
            else:
                log(f'rebuilding {pin.repository} at {pin.short} from PyPI wheels')
                unavailable = rebuild_from_wheels(pin, work, wheel_dir, log)
            check_provided_tree(pin, work, unavailable)
            os.replace(work, dest)
            summary = f'{len(pin.all_blobs) - len(unavailable)} files verified against the pin'
            if unavailable:
                summary += f'; not in the wheels (not needed to train): {", ".join(unavailable)}'
            log(f'pinned upstream {pin.short} is in {dest} (source: {kind}); {summary}')
            return kind
        except UpstreamError as e:
            failures.append(f'{kind}: {e}')
            if kind != order[-1]:
                log(f'{kind} did not work ({e}); trying the next source')
        finally:
            shutil.rmtree(work, ignore_errors=True)
    raise UpstreamError('no source could provide the pinned upstream: ' + '; '.join(failures))


def check_provided_tree(pin: Pin, root: Path, unavailable=()):
    """Refuses root unless every pinned file in it has its blob id and only `unavailable` files are missing (never
    one the series touches)."""
    excused = set(unavailable) - set(pin.touched)
    problems = [path for path, expected in sorted(pin.all_blobs.items()) for found in [file_blob_id(root / path)]
                if found != expected and not (found is None and path in excused)]
    if problems:
        raise UpstreamError(f'files that do not match the pin ({len(problems)}): {", ".join(problems[:8])}')


def default_cache_dir() -> Path:
    base = os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache'
    return Path(base) / 'yolov9-ddp'

