"""Maintainers' round trip between the patch series and commits in a real clone, as ollama's Makefile.sync does it.

`--commits CLONE` feeds the series to `git am -3`, one commit per patch on top of the pin, to edit them as .py
files (and rebase them when upstream moves). `--refresh CLONE` writes the commits pin..HEAD back into patches/,
series and UPSTREAM with `git format-patch --zero-commit`, each mail rewritten as a DEP-3 patch: the same commits
give the same bytes, whatever the user's or the system's git configuration.
"""
import email
import email.policy
import os
import re
from pathlib import Path

from patchkit.gitcmd import first_error, git
from patchkit.pin import PATCH_DIR, PIN_FILE, Pin, format_pin, is_installed
from patchkit.series import DIFF_HEADER, SERIES_FILE, TRAILERS, format_patch_text, slug, split_commit_message
from patchkit.tree import TreeError, write_bytes_atomic

NO_CONFIG = {'GIT_CONFIG_NOSYSTEM': '1', 'GIT_CONFIG_GLOBAL': os.devnull}
# Commits made by --commits carry the kit's name; --refresh ignores authors, so no personal data reaches patches/.
NAME, EMAIL = 'yolov9-ddp', 'yolov9-ddp@users.noreply.github.com'
KIT_IDENTITY = {**NO_CONFIG, 'GIT_AUTHOR_NAME': NAME, 'GIT_AUTHOR_EMAIL': EMAIL, 'GIT_COMMITTER_NAME': NAME,
                'GIT_COMMITTER_EMAIL': EMAIL}
FORMAT_PATCH = ('-c', 'core.quotepath=true', 'format-patch', '--stdout', '--zero-commit', '--no-signature',
                '--keep-subject', '--no-notes', '--no-color', '--full-index', '--stat=72', '--no-renames',
                '--unified=3', '--diff-algorithm=myers', '--src-prefix=a/', '--dst-prefix=b/')
MAIL_START = f'From {"0" * 40} Mon Sep 17 00:00:00 2001\n'
# format-patch follows the diffstat with a summary of created, deleted and mode-changed files; patches do not.
STAT_SUMMARY = re.compile(r'(?m)^( (create|delete) mode | mode change ).*\n|^\n')


def open_clone(clone: Path, pin: Pin):
    if not Path(clone).is_dir() or git(clone, 'rev-parse', '--git-dir', check=False).returncode:
        raise TreeError(f'{clone} is not a git clone', 'give the path of a git clone of the upstream')
    if git(clone, 'cat-file', '-e', f'{pin.commit}^{{commit}}', check=False).returncode:
        raise TreeError(f'{clone} does not contain the pinned commit {pin.short}',
                        f'fetch it: git -C {clone} fetch {pin.repository} {pin.commit}')
    if git(clone, 'status', '--porcelain', '--untracked-files=no').stdout:
        raise TreeError(f'{clone} has uncommitted changes', 'commit or stash them first')


def series_commits(clone: Path, pin: Pin) -> list:
    if git(clone, 'merge-base', '--is-ancestor', pin.commit, 'HEAD', check=False).returncode:
        raise TreeError(f'HEAD of {clone} does not sit on top of the pin {pin.short}',
                        'rebase your commits onto the pin, or bump the pin in patches/UPSTREAM first')
    commits = git(clone, 'rev-list', '--reverse', f'{pin.commit}..HEAD').stdout.split()
    if not commits:
        raise TreeError(f'no commits between the pin {pin.short} and HEAD', 'nothing to refresh')
    merges = git(clone, 'rev-list', '--merges', f'{pin.commit}..HEAD').stdout.split()
    if merges:
        raise TreeError(f'commit {merges[0][:7]} is a merge', 'rebase to a linear history first')
    return commits


def patch_for_mail(commit: str, mail: str):
    """(summary, DEP-3 patch text) of one mail of format-patch."""
    message = email.message_from_string(mail, policy=email.policy.default)
    body, _, rest = message.get_payload().partition('\n---\n')
    summary, description, fields = split_commit_message(f"{message['subject']}\n\n{body}")
    missing = [t for t in ('Upstream-Status', 'Last-Update') if t not in fields]
    if missing:
        raise TreeError(f'commit {commit[:7]} ("{summary}") lacks the trailer line(s) {", ".join(missing)}',
                        'amend its message: "Upstream-Status: Pending" and "Last-Update: YYYY-MM-DD" lines')
    stat, _, diff = rest.partition('\ndiff --git ')
    diff = 'diff --git ' + diff.rstrip('\n') + '\n'
    kit_owned = [path for path, _ in DIFF_HEADER.findall(diff) if is_installed(path)]
    if kit_owned:
        raise TreeError(f'commit {commit[:7]} changes {kit_owned[0]}, a file the kit installs itself',
                        'drop that file from the commit; edit it in the kit repository instead')
    ordered = {k: fields[k] for k in TRAILERS if k in fields}  # in the DEP-3 order, whatever the commit's
    return summary, format_patch_text(summary, description, ordered, STAT_SUMMARY.sub('', stat + '\n'), diff)


def refresh(clone: Path, pin: Pin, patch_dir: Path = PATCH_DIR, log=print) -> list:
    """Rewrite patch_dir from the commits pin..HEAD of clone; returns the patch file names."""
    open_clone(clone, pin)
    commits = series_commits(clone, pin)
    mails = git(clone, *FORMAT_PATCH, f'{pin.commit}..HEAD', env=NO_CONFIG).stdout.split(MAIL_START)[1:]
    texts = {}
    for number, (commit, mail) in enumerate(zip(commits, mails), 1):
        summary, text = patch_for_mail(commit, mail)
        texts[f'{number:04d}-{slug(summary)}.patch'] = text
    listing = git(clone, 'ls-tree', '-r', '-z', pin.commit).stdout.split('\0')
    pinned = {entry.split('\t', 1)[1]: entry.split()[2] for entry in listing if ' blob ' in entry}
    changed = git(clone, 'diff', '--name-only', '-z', '--no-renames', pin.commit, 'HEAD').stdout.split('\0')
    touched = {path: pinned[path] for path in changed if path in pinned}
    tree = {path: blob for path, blob in pinned.items() if path not in touched}
    texts[SERIES_FILE] = ''.join(f'{name}\n' for name in texts)
    texts[PIN_FILE.name] = format_pin(Pin(pin.repository, pin.commit, touched, tree))
    for stale in set(p.name for p in patch_dir.glob('*.patch')) - set(texts):
        (patch_dir / stale).unlink()
    for name, text in texts.items():
        path = patch_dir / name
        if not path.is_file() or path.read_text(encoding='utf-8') != text:
            write_bytes_atomic(path, text.encode())
    log(f'wrote {len(commits)} patches from {clone} ({pin.short}..{commits[-1][:7]}) into {patch_dir}')
    return [n for n in texts if n.endswith('.patch')]


def as_mail(patch) -> str:
    """A patch of the series as a mail for `git am`: the summary as subject, the rest of its message, the diff."""
    headers = (f'{MAIL_START}From: {NAME} <{EMAIL}>\nSubject: {patch.summary}\n'
               'MIME-Version: 1.0\nContent-Type: text/plain; charset=UTF-8\nContent-Transfer-Encoding: 8bit\n\n')
    trailers = ''.join(f'{k}: {v}\n' for k, v in patch.fields.items())
    return headers + (f'{patch.body}\n\n' if patch.body else '') + trailers + '---\n' + patch.diff


def apply_as_commits(clone: Path, pin: Pin, patches, log=print):
    """Apply the series to a clone of the pin with `git am -3`, one commit per patch, for maintainers to edit."""
    open_clone(clone, pin)
    result = git(clone, 'am', '-3', '--keep', '--quiet', input=''.join(map(as_mail, patches)), check=False,
                 env=KIT_IDENTITY)
    if result.returncode:
        git(clone, 'am', '--abort', check=False)
        number = re.search(r'Patch failed at (\d+)', result.stdout + result.stderr)
        name = patches[int(number.group(1)) - 1].name if number else 'the series'
        raise TreeError(f'{name} does not apply to HEAD of {clone}: {first_error(result.stderr)}',
                        f'check out the pin first: git -C {clone} checkout {pin.commit}')
    log(f'committed {len(patches)} patches on top of {pin.short} in {clone}')
