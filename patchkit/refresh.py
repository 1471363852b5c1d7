"""Maintainers' round trip between the patch series and commits in a real clone.

`--commits CLONE` turns the series into one commit per patch on top of the pin, so the patches can
be edited as ordinary .py files (and rebased when upstream moves). `--refresh CLONE` writes the
commits between the pin and HEAD back into patches/, series and UPSTREAM. The output depends only
on the commits: running it twice gives the same bytes, whatever the local git configuration.
"""
from pathlib import Path

import git

from patchkit.applier import INSTALL_SOURCES
from patchkit.gitapply import git_apply
from patchkit.pin import PATCH_DIR, PIN_FILE, Pin, format_pin
from patchkit.series import SERIES_FILE, TRAILERS, format_patch_text, slug, split_commit_message
from patchkit.tree import TreeError, write_bytes_atomic

# Options that pin down every configurable aspect of `git diff` output.
DIFF_OPTIONS = ('--no-color', '--no-ext-diff', '--no-textconv', '--no-renames', '--full-index', '--unified=3',
                '--diff-algorithm=myers', '--src-prefix=a/', '--dst-prefix=b/')
DIFF_CONFIG = ('-c', 'core.quotepath=true', '-c', 'diff.noprefix=false', '-c', 'diff.mnemonicprefix=false')
REQUIRED_TRAILERS = ('Upstream-Status', 'Last-Update')
# Commits made by --commits carry the kit's name; --refresh ignores authors, so no personal data reaches patches/.
KIT_IDENTITY = {'GIT_AUTHOR_NAME': 'yolov9-ddp', 'GIT_AUTHOR_EMAIL': 'yolov9-ddp@users.noreply.github.com',
                'GIT_COMMITTER_NAME': 'yolov9-ddp', 'GIT_COMMITTER_EMAIL': 'yolov9-ddp@users.noreply.github.com'}


def open_clone(clone: Path, pin: Pin) -> git.Repo:
    try:
        repo = git.Repo(clone)
    except (git.NoSuchPathError, git.InvalidGitRepositoryError) as e:
        raise TreeError(f'{clone} is not a git clone', 'give the path of a git clone of the upstream') from e
    try:
        repo.commit(pin.commit)
    except (ValueError, git.BadName) as e:
        raise TreeError(f'{clone} does not contain the pinned commit {pin.short}',
                        f'fetch it: git -C {clone} fetch {pin.repository} {pin.commit}') from e
    if repo.is_dirty(untracked_files=False):
        raise TreeError(f'{clone} has uncommitted changes', 'commit or stash them first')
    return repo


def git_text(repo: git.Repo, *args) -> str:
    """Output of a git command in repo, exactly as git wrote it (GitPython would strip the final newline)."""
    return repo.git.execute(['git', *DIFF_CONFIG, *args], strip_newline_in_stdout=False)


def series_commits(repo: git.Repo, pin: Pin) -> list:
    if not repo.is_ancestor(pin.commit, repo.head.commit):
        raise TreeError(f'HEAD of {repo.working_tree_dir} does not sit on top of the pin {pin.short}',
                        'rebase your commits onto the pin, or bump the pin in patches/UPSTREAM first')
    commits = list(repo.iter_commits(f'{pin.commit}..HEAD', reverse=True))
    if not commits:
        raise TreeError(f'no commits between the pin {pin.short} and HEAD', 'nothing to refresh')
    for commit in commits:
        if len(commit.parents) != 1:
            raise TreeError(f'commit {commit.hexsha[:7]} is a merge', 'rebase to a linear history first')
    return commits


def patch_for_commit(repo: git.Repo, commit) -> str:
    summary, body, fields = split_commit_message(commit.message)
    missing = [t for t in REQUIRED_TRAILERS if t not in fields]
    if missing:
        raise TreeError(f'commit {commit.hexsha[:7]} ("{summary}") lacks the trailer line(s) {", ".join(missing)}',
                        'amend its message: "Upstream-Status: Pending" and "Last-Update: YYYY-MM-DD" lines')
    parent = commit.parents[0].hexsha
    names = git_text(repo, 'diff', '--name-only', '--no-renames', parent, commit.hexsha).split()
    kit_owned = [n for n in names if n.split('/')[0] in INSTALL_SOURCES]
    if kit_owned:
        raise TreeError(f'commit {commit.hexsha[:7]} changes {kit_owned[0]}, a file the kit installs itself',
                        'drop that file from the commit; edit it in the kit repository instead')
    stat = git_text(repo, 'diff', '--stat=72', '--no-color', '--no-renames', parent, commit.hexsha)
    diff = git_text(repo, 'diff', *DIFF_OPTIONS, parent, commit.hexsha)
    ordered = {k: fields[k] for k in TRAILERS if k in fields}
    return format_patch_text(summary, body, ordered, stat, diff)


def refresh(clone: Path, pin: Pin, patch_dir: Path = PATCH_DIR, log=print) -> list:
    """Rewrite patch_dir from the commits pin..HEAD of clone; returns the patch file names."""
    repo = open_clone(clone, pin)
    commits = series_commits(repo, pin)
    texts = {}
    for number, commit in enumerate(commits, 1):
        summary = split_commit_message(commit.message)[0]
        texts[f'{number:04d}-{slug(summary)}.patch'] = patch_for_commit(repo, commit)
    pinned = {blob.path: blob.hexsha for blob in repo.commit(pin.commit).tree.traverse() if blob.type == 'blob'}
    changed = git_text(repo, 'diff', '--name-only', '--no-renames', pin.commit, repo.head.commit.hexsha).split()
    touched = {path: pinned[path] for path in changed if path in pinned}
    tree = {path: blob for path, blob in pinned.items() if path not in touched}
    texts[SERIES_FILE] = ''.join(f'{name}\n' for name in texts)
    texts[PIN_FILE.name] = format_pin(Pin(pin.repository, pin.commit, touched, tree))
    for stale in set(p.name for p in patch_dir.glob('*.patch')) - set(texts):
        (patch_dir / stale).unlink()
    for name, text in texts.items():
        path = patch_dir / name
        if not path.is_file() or path.read_text() != text:
            write_bytes_atomic(path, text.encode())
    log(f'wrote {len(commits)} patches from {clone} ({pin.short}..{repo.head.commit.hexsha[:7]}) into {patch_dir}')
    return [n for n in texts if n.endswith('.patch')]


def apply_as_commits(clone: Path, pin: Pin, patches, log=print):
    """Apply the series to a clone of the pin, one commit per patch, for maintainers to edit."""
    repo = open_clone(clone, pin)
    for patch in patches:
        result = git_apply(Path(repo.working_tree_dir), [patch.path], '--index')
        if not result.ok:
            raise TreeError(f'{patch.name} does not apply to HEAD of {clone}: {result.first_error}',
                            f'check out the pin first: git -C {clone} checkout {pin.commit}')
        repo.git.commit('--quiet', '--no-verify', '-m', patch.commit_message.rstrip('\n'), env=KIT_IDENTITY)
    log(f'committed {len(patches)} patches on top of {repo.head.commit.hexsha[:7]}~{len(patches)} in {clone}')
