"""Drift report: how each patch of the series fares against a tree that is not the pinned one.

The series is replayed in order on a scratch copy of the tree. Each patch gets one status:

  clean      applies as written
  offset     applies, with hunks found some lines away from where they were written
  upstream   already contained in the tree (it reverse-applies): skipped
  fuzz       applies only with reduced context (git apply -C1): drift, the patch needs a refresh
  conflict   does not apply: the file, the hunk and the first line that does not match are named
  missing    a file the patch modifies is not in the tree (deleted or renamed upstream)

A patch that applies (clean, offset, fuzz) is kept on the scratch copy, so later patches are
checked against the tree they would really meet.
"""
import re
import shutil
import tempfile
from pathlib import Path

from patchkit.gitapply import git_apply

PASSING = ('clean', 'offset')
HUNK_HEADER = re.compile(r'^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@', re.M)


def replay_series(target: Path, patches) -> list:
    """One report dict per patch: {'name', 'status', ...details}."""
    reports = []
    with tempfile.TemporaryDirectory(prefix='yolov9-ddp-drift.') as scratch:
        scratch = Path(scratch)
        for path in sorted({f for p in patches for f in p.files}):
            if (target / path).is_file():
                (scratch / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(target / path, scratch / path)
        for patch in patches:
            reports.append({'name': patch.name, **replay_patch(scratch, patch)})
    return reports


def replay_patch(scratch: Path, patch) -> dict:
    missing = [f for f in patch.files if f not in patch.new_files and not (scratch / f).is_file()]
    if missing:
        return {'status': 'missing', 'file': missing[0],
                'detail': f'{missing[0]} is not in the tree (deleted or renamed upstream)'}
    forward = git_apply(scratch, [patch.path], '-v')
    if forward.ok:
        offsets = forward.offsets
        return {'status': 'offset', 'offsets': offsets} if offsets else {'status': 'clean'}
    if git_apply(scratch, [patch.path], '-R', '--check').ok:
        return {'status': 'upstream', 'detail': 'the change is already in the tree; the patch can be dropped'}
    if git_apply(scratch, [patch.path], '-C1').ok:
        return {'status': 'fuzz', 'detail': 'applies only with reduced context (git apply -C1)'}
    return {'status': 'conflict', **describe_conflict(scratch, patch, forward)}


def describe_conflict(scratch: Path, patch, result) -> dict:
    failure = result.failure
    if failure is None:
        return {'detail': result.first_error}
    path, line = failure
    hunks = file_hunks(patch.diff, path)
    number, old_start, expected = min(hunks, key=lambda h: abs(h[1] - line)) if hunks else (None, line, [])
    report = {'file': path, 'hunk': number, 'line': old_start, 'detail': result.first_error}
    actual = (scratch / path).read_text(errors='replace').splitlines()
    for offset, wanted in enumerate(expected):
        found = actual[old_start - 1 + offset] if old_start - 1 + offset < len(actual) else '<end of file>'
        if found != wanted:
            report.update(mismatch_line=old_start + offset, expected_text=wanted, found_text=found)
            break
    return report


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
