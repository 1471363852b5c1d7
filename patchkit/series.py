"""The patch series: patches/series, the numbered patch files, each a DEP-3 header
(https://dep-team.pages.debian.net/deps/dep3/), `---`, a diffstat and the `git diff` text:

    Description: <one-line summary>
     <longer explanation, each line indented by one space; ' .' stands for an empty line>
    Upstream-Status: Pending
    Last-Update: 2026-11-30
    ---
     utils/general.py | 4 ++--
    diff --git a/utils/general.py b/utils/general.py
    ...

The same text maps one-to-one onto a git commit (summary, body, trailer lines), which is how
`apply_patches.py --refresh` writes patches from a maintainer's commits and `--commits` turns them back.
"""
import re
from dataclasses import dataclass
from pathlib import Path

from patchkit.pin import PATCH_DIR

SERIES_FILE = 'series'
REQUIRED_FIELDS = ('Description', 'Upstream-Status', 'Last-Update')
# DEP-3 fields a commit message carries as trailer lines; other lines are description text
TRAILERS = ('Upstream-Status', 'Last-Update', 'Forwarded', 'Bug', 'Origin', 'Author', 'Applied-Upstream')
FIELD_LINE = re.compile(r'^([A-Z][A-Za-z-]*):\s?(.*)$')
DIFF_HEADER = re.compile(r'^diff --git a/(\S+) b/(\S+)$', re.M)


class SeriesError(Exception):
    """The series or one of its patch files is missing or unreadable."""


@dataclass
class Patch:
    name: str
    summary: str
    body: str  # the longer description, plain text, paragraphs separated by blank lines
    fields: dict  # other header fields (Upstream-Status, Last-Update, ...), in file order
    diff: str  # from the first `diff --git` line to the end
    files: list  # paths the diff modifies, in order
    new_files: list  # paths the diff creates


def parse_patch_text(name: str, text: str) -> Patch:
    start = DIFF_HEADER.search(text)
    if start is None:
        raise SeriesError(f'{name}: no "diff --git" section; the file is not a patch or is truncated')
    header = text[:start.start()].split('\n---\n', 1)[0].splitlines()
    fields, description, current = {}, [], None  # continuation lines: of Description, the body
    for number, line in enumerate(header, 1):
        match = FIELD_LINE.match(line)
        if match:
            current, fields[match[1]] = match[1], match[2].strip()
        elif line.startswith(' ') and current:
            description += ['' if line.strip() == '.' else line[1:]] if current == 'Description' else []
        elif line.strip():
            raise SeriesError(f'{name}: header line {number} is not a "Field: value" line: {line!r}')
    missing = [f for f in REQUIRED_FIELDS if not fields.get(f)]
    if missing:
        raise SeriesError(f'{name}: header lacks {", ".join(missing)} (a DEP-3 header must open the patch)')
    diff = text[start.start():]
    sections = [(DIFF_HEADER.match(s).group(2), s) for s in re.split(r'(?m)^(?=diff --git )', diff) if s]
    new_files = [path for path, section in sections if re.search(r'(?m)^new file mode ', section)]
    body = '\n'.join(description).strip('\n')
    return Patch(name, fields.pop('Description'), body, fields, diff, [path for path, _ in sections], new_files)


def format_patch_text(summary: str, body: str, fields: dict, diffstat: str, diff: str) -> str:
    header = [f'Description: {summary}']
    header += [f' {line}' if line.strip() else ' .' for line in body.splitlines()]
    header += [f'{k}: {v}' for k, v in fields.items()]
    return '\n'.join(header) + '\n---\n' + diffstat + diff


def read_series(patch_dir: Path = PATCH_DIR) -> list:
    series = patch_dir / SERIES_FILE
    try:
        names = [line.split('#', 1)[0].strip() for line in series.read_text(encoding='utf-8').splitlines()]
    except OSError as e:
        raise SeriesError(f'cannot read {series}: {e.strerror}') from e
    patches = []
    for name in filter(None, names):
        try:
            text = (patch_dir / name).read_text(encoding='utf-8')
        except (OSError, UnicodeDecodeError) as e:
            raise SeriesError(f'{name}: listed in {series} but cannot be read ({e})') from e
        patches.append(parse_patch_text(name, text))
    if not patches:
        raise SeriesError(f'{series} lists no patches')
    return patches


def split_commit_message(message: str):
    """(summary, body, trailer fields) of a commit message written as a patch header."""
    summary, *rest = message.strip('\n').splitlines()
    trailers = {line: match for line in rest for match in [FIELD_LINE.match(line)] if match and match[1] in TRAILERS}
    body = '\n'.join(line for line in rest if line not in trailers).strip('\n')
    return summary.strip(), body, {match[1]: match[2].strip() for match in trailers.values()}


def slug(summary: str, limit=52) -> str:
    """File-name part for a summary: lower-case words joined by '-', cut at a word boundary."""
    text = '-'.join(re.sub(r'[^A-Za-z0-9]+', ' ', summary).lower().split())
    return text if len(text) <= limit else text[:limit + 1].rsplit('-', 1)[0]
