"""Drift report: how each patch of the series fares against a tree that is not the pinned one.

The series is replayed in order on a scratch copy of the touched files; the tree itself is only read.
Each patch gets one status:

  clean      applies as written
  offset     applies, with hunks found some lines away from where they were written
  upstream   already contained in the tree (it reverse-applies): skipped
  fuzz       applies only with reduced context (git apply -C1): drift, the patch needs a refresh
  conflict   does not apply: the file, the hunk and the first line that does not match are named
  missing    a file the patch modifies is not in the tree (deleted or renamed upstream)

The first three pass: the series still goes in (an 'upstream' patch can simply be dropped). A patch
that applies (clean, offset, fuzz) is kept on the scratch copy, so later patches are checked against
the tree they would really meet; line numbers in a report count in the file as the earlier patches
leave it.
"""
import re
import tempfile
from pathlib import Path

from patchkit.gitapply import OFFSET, git_apply
from patchkit.tree import copy_files

PASSES = ('clean', 'offset', 'upstream')
HUNK_HEADER = re.compile(r'^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@', re.M)
CHECKING = re.compile(r'^Checking patch (\S+)\.\.\.$')
REDUCED = re.compile(r'Context reduced to \((\d+)/(\d+)\) to apply fragment at (\d+)')


def replay_series(target: Path, patches) -> list:
    """One report dict per patch: {'name', 'status', 'passes', ...details}."""
    reports = []
    with tempfile.TemporaryDirectory(prefix='yolov9-ddp-drift.') as scratch:
        scratch = Path(scratch)
        copy_files(target, sorted({f for p in patches for f in p.files}), scratch)
        for patch in patches:
            report = replay_patch(scratch, patch)
            reports.append({'name': patch.name, 'passes': report['status'] in PASSES, **report})
    return reports


def replay_patch(scratch: Path, patch) -> dict:
    missing = [f for f in patch.files if f not in patch.new_files and not (scratch / f).is_file()]
    if missing:
        return {'status': 'missing', 'file': missing[0],
                'detail': f'{missing[0]} is not in the tree (deleted or renamed upstream)'}
    forward = git_apply(scratch, [patch.path], '-v')
    if forward.ok:
        offsets = [{'file': path, 'hunk': int(m[1]), 'line': int(m[2]), 'offset': int(m[3])}
                   for path, m in per_file(forward.output, OFFSET)]
        if not offsets:
            return {'status': 'clean'}
        return {'status': 'offset', 'offsets': offsets, 'detail': describe_offsets(offsets)}
    if git_apply(scratch, [patch.path], '-R', '--check').ok:
        return {'status': 'upstream', 'detail': 'the change is already in the tree; the patch can be dropped'}
    fuzzed = git_apply(scratch, [patch.path], '-C1', '-v')
    if fuzzed.ok:
        detail = 'applies only with reduced context (git apply -C1)'
        reduced = [f'{path} at line {m[3]} (context {m[1]}/{m[2]})' for path, m in per_file(fuzzed.output, REDUCED)]
        return {'status': 'fuzz', 'detail': f"{detail}: {', '.join(reduced)}" if reduced else detail}
    return {'status': 'conflict', **describe_conflict(scratch, patch, forward)}


def describe_offsets(offsets) -> str:
    """'hunks moved (lines): a.py #1 +2, #3 +2; b.py #1 -1' for [{'file', 'hunk', 'offset'}]."""
    files = dict.fromkeys(o['file'] for o in offsets)
    return 'hunks moved (lines): ' + '; '.join(
        f"{path} " + ', '.join(f"#{o['hunk']} {o['offset']:+d}" for o in offsets if o['file'] == path)
        for path in files)


def per_file(output: str, pattern) -> list:
    """[(file, match)] for each line of `git apply -v` output matching pattern, with the file git was checking."""
    found, path = [], None
    for line in output.splitlines():
        checking = CHECKING.match(line)
        if checking:
            path = checking.group(1)
        match = pattern.search(line)
        if match:
            found.append((path, match))
    return found


def describe_conflict(scratch: Path, patch, result) -> dict:
    # git's first error line may be "error: while searching for:"; the "patch failed" line names the place
    detail = next((text for text in result.output.splitlines() if 'patch failed:' in text), result.first_error)
    failure = result.failure
    if failure is None or failure[1] is None:
        return {'detail': detail}
    path, line = failure  # git names the line the failing hunk was written for
    hunks = file_hunks(patch.diff, path)
    if not hunks:
        return {'file': path, 'line': line, 'detail': detail}
    number, old_start, expected = min(hunks, key=lambda h: abs(h[1] - line))
    report = {'file': path, 'hunk': number, 'line': old_start, 'detail': detail}
    actual = (scratch / path).read_text(errors='replace').splitlines()
    report.update(first_mismatch(actual, expected, old_start))
    return report


def first_mismatch(actual: list, expected: list, written_at: int) -> dict:
    """{'mismatch_line', 'expected_text', 'found_text'} of the first line of a hunk the file does not hold
    ({} when it holds them all).

    The hunk is laid over the file where most of its lines match (the nearest such place to where it
    was written), so lines inserted or removed above it do not make every line look different.
    """
    def matching(start):
        return sum(start + i < len(actual) and actual[start + i] == line for i, line in enumerate(expected))

    start = max(range(len(actual) + 1), key=lambda s: (matching(s), -abs(s - (written_at - 1))))
    for i, wanted in enumerate(expected):
        found = actual[start + i] if start + i < len(actual) else '<end of file>'
        if found != wanted:
            return {'mismatch_line': start + i + 1, 'expected_text': wanted, 'found_text': found}
    return {}


def file_hunks(diff: str, path: str) -> list:
    """[(hunk number in the file, old start line, lines the hunk expects to find)] for one file of a diff."""
    for section in re.split(r'(?m)^(?=diff --git )', diff):
        if not section.startswith(f'diff --git a/{path} '):
            continue
        hunks = []
        bodies = HUNK_HEADER.split(section)
        # split gives [preamble, start, count, body, start, count, body, ...]
        for number, index in enumerate(range(1, len(bodies), 3), 1):
            body = bodies[index + 2].split('\n')[1:]
            expected = [l[1:] for l in body if l[:1] in (' ', '-')]
            hunks.append((number, int(bodies[index]), expected))
        return hunks
    return []
