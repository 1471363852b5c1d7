"""git as a plain command, and the scratch folders where it applies, reverses, merges and diffs a tree's content
(a dict {path: bytes, or None for an absent file}); the applier writes the bytes git computed into the target.

git runs with LC_ALL=C and without LANGUAGE: its messages are parsed (offsets, failing hunks), and translated
they would not match. GIT_CEILING_DIRECTORIES keeps it from finding a repository above the folder it runs in
(a scratch folder, or a YOLOv9 copy vendored inside another project).
"""
import os
import re
import subprocess
import tempfile
from pathlib import Path

from patchkit.tree import TreeError, write_bytes_atomic

OFFSET = re.compile(r'Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)')
FAILED_AT = re.compile(r'error: patch failed: (\S+):(\d+)')


def git(cwd, *args, input=None, binary=False, check=True, env=None) -> subprocess.CompletedProcess:
    """Run git in cwd (with `env` added to the environment); with check, a failure is a TreeError quoting git."""
    environment = {k: v for k, v in os.environ.items() if k != 'LANGUAGE' and not k.startswith('GIT_')}
    environment.update(LC_ALL='C', GIT_CEILING_DIRECTORIES=str(Path(cwd).resolve().parent), **(env or {}))
    text = {} if binary else {'encoding': 'utf-8', 'errors': 'surrogateescape'}
    try:
        result = subprocess.run(['git', *args], cwd=cwd, env=environment, input=input, capture_output=True, **text)
    except FileNotFoundError as e:
        raise TreeError('git is not installed', 'install git (https://git-scm.com), then run this again') from e
    if check and result.returncode:
        stderr = result.stderr.decode(errors='replace') if binary else result.stderr
        raise TreeError(f'git {args[0]} failed in {cwd}: {first_error(stderr)}', 'report this as a bug')
    return result


def first_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(('error:', 'fatal:'))]
    return lines[0] if lines else output.strip().splitlines()[-1] if output.strip() else ''


def failed_at(output: str):
    """(path, line) git names for the first hunk that did not apply (the line it was written for), or None."""
    match = FAILED_AT.search(output)
    return (match.group(1), int(match.group(2))) if match else None


def read_contents(root: Path, paths) -> dict:
    return {path: (root / path).read_bytes() if (root / path).is_file() else None for path in paths}


def write_contents(root: Path, contents: dict):
    for path, data in contents.items():
        if data is not None:
            write_bytes_atomic(root / path, data)


def apply_diff(contents: dict, diff: str, *flags):
    """(contents afterwards, or None where the diff does not apply; git's messages) of `git apply FLAGS` of a diff
    text on a scratch copy of contents."""
    with tempfile.TemporaryDirectory(prefix='yolov9-ddp.') as scratch:
        write_contents(Path(scratch), contents)
        result = git(scratch, 'apply', '--whitespace=nowarn', *flags, input=diff, check=False)
        after = None if result.returncode else read_contents(Path(scratch), contents)
        return after, f'{result.stderr}\n{result.stdout}'.strip()


def diff_contents(before: dict, after: dict, *options) -> str:
    """`git diff` text from before to after (full blob ids: `git apply -R` of it gives before back exactly)."""
    changed = [path for path in sorted(set(before) | set(after)) if before.get(path) != after.get(path)]
    with tempfile.TemporaryDirectory(prefix='yolov9-ddp.') as scratch:
        for side, contents in (('a', before), ('b', after)):
            (Path(scratch) / side).mkdir()
            write_contents(Path(scratch) / side, {path: contents.get(path) for path in changed})
        # the folders are named a and b: without a prefix of its own, git names each file a/PATH and b/PATH
        return git(scratch, 'diff', '--no-index', '--no-prefix', '--full-index', '--binary', '--no-color',
                   '--no-ext-diff', '--no-textconv', '--no-renames', *options, 'a', 'b', check=False).stdout


def merge_file(ours: bytes, base: bytes, theirs: bytes):
    """(merged bytes, number of conflicts) of `git merge-file`: the changes base -> theirs made to ours."""
    with tempfile.TemporaryDirectory(prefix='yolov9-ddp.') as scratch:
        write_contents(Path(scratch), {'ours': ours, 'base': base, 'theirs': theirs})
        result = git(scratch, 'merge-file', '-p', '-L', 'your file', '-L', 'pinned', '-L', 'patched',
                     'ours', 'base', 'theirs', binary=True, check=False)
    if result.returncode > 127:  # git reports an error as a negative count
        raise TreeError(f'git merge-file failed: {first_error(result.stderr.decode(errors="replace"))}',
                        'report this as a bug')
    return result.stdout, result.returncode


def blobs_at(repository: Path, revision: str, paths) -> dict:
    """{path: blob id, or None where missing} of a revision, from one `git cat-file --batch-check`."""
    query = ''.join(f'{revision}:{path}\n' for path in paths)
    lines = git(repository, 'cat-file', '--batch-check=%(objectname)', input=query).stdout.splitlines()
    return {path: None if line.endswith(' missing') else line for path, line in zip(paths, lines)}


def local_pin_commit(repository: Path, pinned: dict):
    """The upstream commit under the clone's local work, when it holds the pinned blobs (else None): the newest
    commit of HEAD's history that a remote-tracking branch holds (where a clone keeps upstream's commits), or
    without any, the first commit. Every change to the touched files after it is then a local edit."""
    history = git(repository, 'rev-list', 'HEAD', check=False).stdout.split()
    local = set(git(repository, 'rev-list', 'HEAD', '--not', '--remotes', check=False).stdout.split())
    base = next((commit for commit in history if commit not in local), history[-1] if history else None)
    return base if base and blobs_at(repository, base, sorted(pinned)) == pinned else None
