"""Drift report: the series replayed patch by patch on a tree's content (the tree itself is only read).

Each patch gets one status: clean (applies as written), offset (applies, hunks found some lines away),
upstream (already contained: it reverse-applies; skipped), fuzz (applies only with reduced context,
git apply -C1), conflict (does not apply: the file, the hunk and the first line that does not match are
named) or missing (a file it modifies is not in the tree). The first three pass. A patch that applies
stays applied, so later patches meet the tree they really would (line numbers count in the file as the
earlier patches leave it); when every patch passes, the result is what `--allow-other-revision` applies.
"""
import re

from patchkit.gitcmd import OFFSET, apply_diff, failed_at, first_error

PASSES = ('clean', 'offset', 'upstream')
HUNK_HEADER = re.compile(r'^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@', re.M)
CHECKING = re.compile(r'^Checking patch (\S+)\.\.\.$')
REDUCED = re.compile(r'Context reduced to \((\d+)/(\d+)\) to apply fragment at (\d+)')


def replay_series(contents: dict, patches):
    """(one report dict per patch: {'name', 'status', 'passes', ...details}, contents with every patch that
    applied applied): the series replayed on a tree's content ({path: bytes or None})."""
    reports = []
    for patch in patches:
        report, contents = replay_patch(contents, patch)
        reports.append({'name': patch.name, 'passes': report['status'] in PASSES, **report})
    return reports, contents


def replay_patch(contents: dict, patch):
    missing = [f for f in patch.files if f not in patch.new_files and contents.get(f) is None]
    if missing:
        return {'status': 'missing', 'file': missing[0],
                'detail': f'{missing[0]} is not in the tree (deleted or renamed upstream)'}, contents
    applied, forward = apply_diff(contents, patch.diff, '-v')
    if applied is not None:
        offsets = [{'file': path, 'hunk': int(m[1]), 'line': int(m[2]), 'offset': int(m[3])}
                   for path, m in per_file(forward, OFFSET)]
        if not offsets:
            return {'status': 'clean'}, applied
        return {'status': 'offset', 'offsets': offsets, 'detail': describe_offsets(offsets)}, applied
    if apply_diff(contents, patch.diff, '-R', '--check')[0] is not None:
        return {'status': 'upstream', 'detail': 'the change is already in the tree; the patch can be dropped'}, contents
    applied, fuzzed = apply_diff(contents, patch.diff, '-C1', '-v')
    if applied is not None:
        detail = 'applies only with reduced context (git apply -C1)'
        reduced = [f'{path} at line {m[3]} (context {m[1]}/{m[2]})' for path, m in per_file(fuzzed, REDUCED)]
        return {'status': 'fuzz', 'detail': f"{detail}: {', '.join(reduced)}" if reduced else detail}, applied
    return {'status': 'conflict', **describe_conflict(contents, patch, forward)}, contents


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
        path = CHECKING.match(line).group(1) if CHECKING.match(line) else path
        found += [(path, match) for match in [pattern.search(line)] if match]
    return found


def describe_conflict(contents: dict, patch, output) -> dict:
    # git's first error line may be "error: while searching for:"; the "patch failed" line names the place
    detail = next((text for text in output.splitlines() if 'patch failed:' in text), first_error(output))
    path, line = failed_at(output) or (None, None)
    hunks = file_hunks(patch.diff, path) if path else []
    if not hunks:
        return {'detail': detail, **({'file': path, 'line': line} if path else {})}
    number, old_start, expected = min(hunks, key=lambda h: abs(h[1] - line))
    actual = (contents.get(path) or b'').decode(errors='replace').splitlines()
    return {'file': path, 'hunk': number, 'line': old_start, 'detail': detail,
            **first_mismatch(actual, expected, old_start)}


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
    section = next((s for s in re.split(r'(?m)^(?=diff --git )', diff) if s.startswith(f'diff --git a/{path} ')), '')
    parts = HUNK_HEADER.split(section)  # [preamble, start, count, body, start, count, body, ...]
    return [(number, int(parts[i]), [line[1:] for line in parts[i + 2].split('\n')[1:] if line[:1] in (' ', '-')])
            for number, i in enumerate(range(1, len(parts), 3), 1)]
