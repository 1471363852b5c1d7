"""The kit's own files, the pinned upstream read from patches/UPSTREAM, and content checks against it.

patches/UPSTREAM is the only place the kit names the upstream commit. It also records the git blob id of every
file of that commit: the files the series touches (checked before every apply) and the rest of the tree (checked
when the tree is rebuilt offline).
"""
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

# Files the applier installs into the target (an entry point, or a package folder), relative to the kit root.
# A wheel of the kit carries them and patches/ under patchkit/kit/ (setup.py), a checkout at its root.
INSTALLED = ('ddp_train.py', 'ddp_train_dual.py', 'ddp_train_triple.py', 'segment/ddp_train.py',
             'segment/ddp_train_dual.py', 'yolov9_ddp')
PACKAGED = Path(__file__).resolve().parent / 'kit'
KIT_ROOT = PACKAGED if PACKAGED.is_dir() else Path(__file__).resolve().parents[1]
PATCH_DIR = KIT_ROOT / 'patches'
PIN_FILE = PATCH_DIR / 'UPSTREAM'

TOUCHED_SECTION = '[touched]'
TREE_SECTION = '[tree]'


class PinError(Exception):
    """patches/UPSTREAM is missing or malformed."""


@dataclass(frozen=True)
class Pin:
    repository: str
    commit: str
    touched: dict  # path -> blob id, the files the patch series modifies
    tree: dict  # path -> blob id, every other file of the pinned commit

    @property
    def short(self):
        return self.commit[:7]

    @property
    def all_blobs(self):
        return {**self.tree, **self.touched}


def blob_id(data: bytes):
    """The id `git hash-object` gives these bytes (equal ids mean byte-identical files); None for None."""
    return None if data is None else hashlib.sha1(b'blob %d\0' % len(data) + data).hexdigest()


def is_installed(path: str) -> bool:
    """Whether a path of the target (relative, with /) is one of the kit's installed files."""
    return any(path == name or path.startswith(f'{name}/') for name in INSTALLED)


def kit_files() -> dict:
    """{path relative to the target: bytes} of every kit file the applier installs."""
    paths = [path for name in INSTALLED for path in [KIT_ROOT / name, *sorted((KIT_ROOT / name).rglob('*'))]]
    return {path.relative_to(KIT_ROOT).as_posix(): path.read_bytes() for path in paths
            if path.is_file() and '__pycache__' not in path.parts}


def kit_version() -> str:
    """yolov9_ddp.__version__, read without importing the package (an installed kit carries it as data)."""
    text = (KIT_ROOT / 'yolov9_ddp' / '__init__.py').read_text(encoding='utf-8')
    return re.search(r"^__version__ = '([^']+)'", text, re.M).group(1)


def file_blob_id(path: Path):
    """Blob id of a file, or None when it does not exist."""
    try:
        return blob_id(Path(path).read_bytes())
    except FileNotFoundError:
        return None


def read_pin(path: Path = PIN_FILE) -> Pin:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise PinError(f'cannot read the pin file {path}: {e.strerror}') from e
    fields, sections, section = {}, {TOUCHED_SECTION: {}, TREE_SECTION: {}}, None
    for number, raw in enumerate(lines, 1):
        line = raw.split('#', 1)[0].strip()
        key, _, value = line.partition(' ')
        value = value.strip()
        if line in sections:
            section = line
        elif section is None and key in ('repository', 'commit') and value:
            fields[key] = value
        elif section is not None and len(key) == 40 and value:
            sections[section][value] = key
        elif line:
            raise PinError(f'{path}:{number}: cannot parse {raw!r}')
    missing = {'repository', 'commit'} - fields.keys()
    if missing or not sections[TOUCHED_SECTION]:
        raise PinError(f'{path}: missing {", ".join(sorted(missing)) or TOUCHED_SECTION + " blob ids"}')
    return Pin(fields['repository'], fields['commit'], sections[TOUCHED_SECTION], sections[TREE_SECTION])


def format_pin(pin: Pin) -> str:
    """The text of patches/UPSTREAM for `pin`; sorted, so a refresh rewrites it byte for byte."""
    out = [
        '# The pinned upstream: the one place the kit names the commit the patch series applies to.',
        '# Blob ids are `git hash-object` ids: a file whose id matches is byte-identical to the pinned file.',
        f'repository {pin.repository}',
        f'commit {pin.commit}',
        '',
        '# Files the series touches: apply_patches.py checks each of them before applying.',
        TOUCHED_SECTION,
        *(f'{blob} {path}' for path, blob in sorted(pin.touched.items())),
        '',
        '# The rest of the pinned tree: checked when the tree is rebuilt offline (fetch_upstream.py).',
        TREE_SECTION,
        *(f'{blob} {path}' for path, blob in sorted(pin.tree.items())),
    ]
    return '\n'.join(out) + '\n'
