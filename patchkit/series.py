"""The patch series: patches/series, the numbered patch files and their DEP-3 headers.

A patch file opens with a DEP-3 header (https://dep-team.pages.debian.net/deps/dep3/), then `---`,
a diffstat and the `git diff` text:

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
from dataclasses import dataclass, field
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
    path: Path
    summary: str
    body: str  # the longer description, plain text, paragraphs separated by blank lines
    fields: dict  # other header fields (Upstream-Status, Last-Update, ...), in file order
    diff: str  # from the first `diff --git` line to the end
    files: list = field(default_factory=list)  # paths the diff modifies, in order
    new_files: list = field(default_factory=list)  # paths the diff creates

    @property
    def commit_message(self):
        parts = [self.summary]
        if self.body:
            parts.append(self.body)
        parts.append('\n'.join(f'{k}: {v}' for k, v in self.fields.items()))
        return '\n\n'.join(parts) + '\n'


def parse_patch_text(name: str, text: str, path: Path = None) -> Patch:
    start = DIFF_HEADER.search(text)
    if start is None:
        raise SeriesError(f'{name}: no "diff --git" section; the file is not a patch or is truncated')
    header = text[:start.start()].split('\n---\n', 1)[0].splitlines()
    fields, lines, current = {}, {}, None
    for number, line in enumerate(header, 1):
        match = FIELD_LINE.match(line)
        if match:
            current = match.group(1)
            fields[current] = match.group(2).strip()
            lines[current] = []
        elif line.startswith(' ') and current:
            lines[current].append('' if line.strip() == '.' else line[1:])
        elif line.strip():
            raise SeriesError(f'{name}: header line {number} is not a "Field: value" line: {line!r}')
    missing = [f for f in REQUIRED_FIELDS if not fields.get(f)]
    if missing:
        raise SeriesError(f'{name}: header lacks {", ".join(missing)} (a DEP-3 header must open the patch)')
    diff = text[start.start():]
    sections = [(DIFF_HEADER.match(s).group(2), s) for s in re.split(r'(?m)^(?=diff --git )', diff) if s]
    files = [path for path, _ in sections]
    new_files = [path for path, section in sections if re.search(r'(?m)^new file mode ', section)]
    summary = fields.pop('Description')
    body = '\n'.join(lines.get('Description', [])).strip('\n')
    return Patch(name, path, summary, body, fields, diff, files, new_files)


def format_patch_text(summary: str, body: str, fields: dict, diffstat: str, diff: str) -> str:
    header = [f'Description: {summary}']
    header += [f' {line}' if line.strip() else ' .' for line in body.splitlines()]
    header += [f'{k}: {v}' for k, v in fields.items()]
    return '\n'.join(header) + '\n---\n' + diffstat + diff


def read_series(patch_dir: Path = PATCH_DIR) -> list:
    series = patch_dir / SERIES_FILE
    try:
        names = [line.split('#', 1)[0].strip() for line in series.read_text().splitlines()]
    except OSError as e:
        raise SeriesError(f'cannot read {series}: {e.strerror}') from e
    patches = []
    for name in filter(None, names):
        path = patch_dir / name
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SeriesError(f'{name}: listed in {series} but cannot be read ({e})') from e
        patches.append(parse_patch_text(name, text, path))
    if not patches:
        raise SeriesError(f'{series} lists no patches')
    return patches


def touched_files(patches) -> list:
    """Upstream files the series modifies (files it creates are not upstream's)."""
    created = {f for p in patches for f in p.new_files}
    return sorted({f for p in patches for f in p.files} - created)


def split_commit_message(message: str):
    """(summary, body, trailer fields) of a commit message written as a patch header."""
    lines = message.strip('\n').splitlines()
    summary, rest = lines[0].strip(), lines[1:]
    fields, body = {}, []
    for line in rest:
        match = FIELD_LINE.match(line)
        if match and match.group(1) in TRAILERS:
            fields[match.group(1)] = match.group(2).strip()
        else:
            body.append(line)
    return summary, '\n'.join(body).strip('\n'), fields


def slug(summary: str, limit=52) -> str:
    """File-name part for a summary: lower-case words joined by '-', cut at a word boundary."""
    words = re.sub(r'[^A-Za-z0-9]+', ' ', summary).lower().split()
    out = words[0]
    for word in words[1:]:
        if len(out) + 1 + len(word) > limit:
            break
        out += '-' + word
    return out
