"""Check, apply, revert and report the patch series on a target tree, all-or-nothing. A tree is one of these kinds:

  pristine   the touched files are the pinned ones
  applied    this kit's series is applied (recorded in .yolov9-ddp.json, or found by reversing the series)
  outdated   another kit version applied its series: apply upgrades it, revert takes it out
  partial    the pin plus the first patches of the series, by hand: revert takes them out
  edited     a git clone of the pin with local edits to touched files, committed or not: apply merges them
  modified   anything else: another upstream revision, or edits in a copy without history (drift report)

git computes every change in a scratch folder (patchkit.gitcmd), written into the tree under a journal. The record
says what was applied, down to the diff from the tree as it was, so any later kit reverses it (`git apply -R`).
Operations return a report (a dict, printed as text or JSON by apply_patches.py) and raise TreeError for anything
that stops them, leaving the tree as it was.
"""
import contextlib
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from patchkit import drift
from patchkit.gitcmd import (apply_diff, blobs_at, diff_contents, failed_at, first_error, git, local_pin_commit,
                             merge_file, read_contents)
from patchkit.pin import INSTALLED, KIT_ROOT, PATCH_DIR, blob_id, file_blob_id, kit_files, kit_version
from patchkit.series import DIFF_HEADER
from patchkit.tree import (JOURNAL_DIR, STATE_FILE, TreeError, check_is_yolov9_tree, exclude_text, journaled,
                           read_state, remove_file, restore_from_journal, tree_lock, write_bytes_atomic)

EXIT_OK, EXIT_FAILED, EXIT_MOVED = 0, 1, 3
ALLOW_FLAG = '--allow-other-revision'
# Kit 0.1.0 recorded no diff; the series it applied, as one diff from the pin, lets any later kit reverse it.
KIT_0_1_0_DIFF = PATCH_DIR / 'previous' / 'kit-0.1.0.diff'
EDIT_HUNK = re.compile(r'^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,\d+)? @@', re.M)


@dataclass
class Tree:
    kind: str
    applied: int  # how many leading patches of this series the tree holds
    files: list  # {'path', 'expected' (pinned blob), 'found' (None: missing), 'matches'} of every touched file
    contents: dict  # {path: bytes or None} of every file the series or the recorded diff touches
    committed: dict  # blob ids at HEAD of a git clone
    base: dict = None  # the contents as they were before the kit (None: its change could not be reversed)
    record: dict = field(default_factory=dict)
    undone: str = ''  # git's messages on reversing the recorded change
    kit: str = None  # the version of the kit that applied its series, where recorded (0.1.0 recorded none)


def counts(reports) -> str:
    moved = [r['status'] for r in reports if r['status'] != 'clean']
    return ', '.join(f'{moved.count(status)} {status}' for status in drift.PASSES if status in moved)


def failing(reports) -> list:
    return [f"{r['name']} ({r['status']})" for r in reports if not r['passes']]


def nearest_hunk(patch, path, edits_diff):
    """(hunk number, line in the edited file) of the hunk of `patch` nearest to an edit of `edits_diff` (-U0)."""
    edits = [(int(a), int(a) + max(int(b or 1), 1) - 1, int(c)) for a, b, c in EDIT_HUNK.findall(edits_diff)]
    hunks = [(number, start, start + len(lines) - 1) for number, start, lines in drift.file_hunks(patch.diff, path)]
    hunk, edit = min(((h, e) for h in hunks for e in edits), key=lambda p: max(0, p[1][0] - p[0][2], p[0][1] - p[1][1]))
    return hunk[0], edit[2]


class Applier:
    def __init__(self, target, pin, patches, log=print, allow_other_revision=False):
        self.target = Path(target).resolve()
        self.pin, self.patches, self.log, self.allow_other_revision = pin, patches, log, allow_other_revision
        self.series = ''.join(p.diff for p in patches)  # one `git apply` of it applies the whole series
        self.series_id = hashlib.sha1(self.series.encode()).hexdigest()
        self.created = sorted({f for p in patches for f in p.new_files})
        self.repository = (self.target / '.git').exists()

    # -- what the tree holds -------------------------------------------------------------------

    def inspect(self) -> Tree:
        check_is_yolov9_tree(self.target)
        record = read_state(self.target)
        # a record without a diff is kit 0.1.0's; a recorded diff may be '' (every patch already upstream)
        undo = record['diff'] if 'diff' in record else KIT_0_1_0_DIFF.read_text(encoding='utf-8') if record else ''
        paths = set(self.pin.touched) | set(self.created) | {path for _, path in DIFF_HEADER.findall(undo)}
        contents = read_contents(self.target, sorted(paths))
        committed = blobs_at(self.target, 'HEAD', sorted(self.pin.touched)) if self.repository else {}
        files = [{'path': path, 'expected': blob, 'found': blob_id(contents[path]),
                  'matches': blob_id(contents[path]) == blob} for path, blob in sorted(self.pin.touched.items())]
        if record:
            current = record.get('series') == self.series_id
            base, undone = apply_diff(contents, undo, '-R') if undo else (contents, '')
            return Tree('applied' if current else 'outdated', len(self.patches) * current, files, contents, committed,
                        base, record, undone, record.get('version', '0.1.0'))
        if all(f['matches'] for f in files):
            return Tree('pristine', 0, files, contents, committed, contents)
        k, base = next(((k, base) for k in range(len(self.patches), 0, -1)
                        for base in [self.pin_under(contents, k)] if base), (0, contents))
        if k == len(self.patches) or (k and any(f['found'] != committed.get(f['path']) for f in files)):
            return Tree('applied' if k == len(self.patches) else 'partial', k, files, contents, committed, base)
        return Tree('edited' if self.pinned else 'modified', 0, files, contents, committed, contents)

    def pin_under(self, contents, k):
        """contents with patches[:k] reversed, if that gives the pinned files, else None (patches reverse in one
        `git apply -R` of them in their order: git undoes them last to first)."""
        base, _ = apply_diff(contents, ''.join(p.diff for p in self.patches[:k]), '-R')
        return base if base and all(blob_id(base[path]) == blob for path, blob in self.pin.touched.items()) else None

    @functools.cached_property
    def pinned(self):
        """{path: pinned bytes} from the clone's history when the tree's differences are local edits, else None."""
        if not self.repository or local_pin_commit(self.target, self.pin.touched) is None:
            return None
        return {path: git(self.target, 'cat-file', 'blob', blob, binary=True).stdout
                for path, blob in self.pin.touched.items()}

    # -- what apply writes ---------------------------------------------------------------------

    def plan(self, tree):
        """(contents after apply, files merged with local edits, drift report of another revision or None)."""
        if tree.kind == 'partial':
            raise self.partial_error(tree)
        base = self.before_kit(tree)
        created = [path for path in self.created if base.get(path) is not None]
        if created:
            raise TreeError(f'{created[0]} exists in the target, but the series creates it',
                            'move it away, then run this command again')
        edited = [path for path, blob in sorted(self.pin.touched.items()) if blob_id(base[path]) != blob]
        if not edited:
            return self.series_on(base), [], None
        if self.pinned is not None:
            return self.merged(base, edited), edited, None
        reports, result = drift.replay_series(base, self.patches)
        if failing(reports) or not (self.allow_other_revision or tree.record.get('other_revision')):
            raise self.other_revision_error(tree, reports)
        return result, [], reports

    def before_kit(self, tree) -> dict:
        """The tree's contents as they were before the kit; refuses a tree changed since the kit patched it."""
        if tree.base is None:
            path = (failed_at(tree.undone) or ['a touched file'])[0]
            raise TreeError(f'{path} was changed after kit {tree.kit} patched this tree: {first_error(tree.undone)}',
                            'undo that change (save it elsewhere first), then run this command again')
        return tree.base

    def series_on(self, pinned) -> dict:
        """The series applied to pinned contents by one `git apply`; a patch that fails there is damaged."""
        applied, output = apply_diff(pinned, self.series)
        if applied is not None:
            return applied
        bad = next((r for r in drift.replay_series(pinned, self.patches)[0] if r['status'] != 'clean'), None)
        raise TreeError(f"{bad['name']} does not apply to the pinned files: {bad.get('detail') or bad['status']}"
                        if bad else f'the series does not apply to the pinned files: {first_error(output)}',
                        'the patch file is damaged; restore patches/ from the kit repository')

    def merged(self, base, edited) -> dict:
        """The series merged into locally edited files (git merge-file, with the pinned blobs as their base)."""
        result = self.series_on({**base, **self.pinned})
        for path in edited:
            if base[path] is None:
                raise TreeError(f'{path} is missing: the series needs it', f'restore it: git checkout HEAD -- {path}')
            result[path], conflicts = merge_file(base[path], self.pinned[path], result[path])
            if conflicts:
                raise self.conflict_error(path, base[path])
        return result

    # -- refusals ------------------------------------------------------------------------------

    def conflict_error(self, path, edited) -> TreeError:
        """Names the patch and hunk a local edit conflicts with, merging the patches one at a time."""
        base = self.pinned[path]
        for patch in (p for p in self.patches if path in p.files):
            patched = apply_diff({path: base}, patch.diff, f'--include={path}')[0][path]
            merged, conflicts = merge_file(edited, base, patched)
            if conflicts:
                hunk, line = nearest_hunk(patch, path, diff_contents({path: base}, {path: edited}, '-U0'))
                return TreeError(f'{path}: your edit at line {line} conflicts with hunk {hunk} of {patch.name}',
                                 'save that edit and undo it, apply, then make it again in the patched file '
                                 '(the tree is unchanged)')
            base, edited = patched, merged
        return TreeError(f'{path}: your edits conflict with the series', 'save them and undo them, then apply')

    def other_revision_error(self, tree, reports) -> TreeError:
        pin, moved = f'check out the pin (git checkout {self.pin.commit})', counts(reports) and f' ({counts(reports)})'
        return TreeError(self.mismatch(tree), drift=reports, hint=(
            f'the series does not apply to this tree ({", ".join(failing(reports))}): {pin} or see docs/applier.md, '
            f'"When upstream moves"' if failing(reports) else f'this tree is another upstream revision (or a copy with '
            f'edits) on which every patch still applies{moved}: add {ALLOW_FLAG} to apply the series anyway, or {pin}'))

    def mismatch(self, tree) -> str:
        """The first touched file that is not the pinned one (in the tree as it was before the kit), as a cause."""
        differing = [(path, blob, blob_id(tree.base[path])) for path, blob in sorted(self.pin.touched.items())
                     if blob_id(tree.base[path]) != blob]
        (path, expected, found), others = differing[0], len(differing) - 1
        more = f' (and {others} more file{"s" * (others > 1)})' if others else ''
        if found is None:
            return f'{path} is missing: the series needs it{more}'
        return f'{path} differs from the pin {self.pin.short}: expected blob {expected}, found {found}{more}'

    def partial_error(self, tree) -> TreeError:
        names, hint = [p.name for p in self.patches], 'run apply_patches.py --revert TARGET, then apply again'
        applied = names[0] if tree.applied == 1 else f'{names[0]}..{names[tree.applied - 1]}'
        message = f'the series is half-applied: {applied} applied, {names[tree.applied]}.. not'
        # only a git clone whose HEAD holds the pinned files proves the prefix was applied on top of the pin
        if not all(tree.committed.get(f['path']) == f['expected'] for f in tree.files):
            message += ('; or this is another upstream revision that already contains those fixes (no git history '
                        'tells the two apart)')
            hint = (f'if you applied them by hand, {hint}; if another revision, see docs/applier.md, '
                    '"When upstream moves"')
        return TreeError(message, hint, drift=drift.replay_series(tree.contents, self.patches)[0])

    # -- operations ----------------------------------------------------------------------------

    def status(self):
        tree = self.inspect()
        recorded, current = tree.record.get('installed', {}), {k: blob_id(v) for k, v in kit_files().items()}
        found = {path: file_blob_id(self.target / path) for path in sorted(set(recorded) | set(current))}
        installed = [{'path': path, 'status': 'missing' if blob is None else 'current' if blob == current.get(path)
                      else 'older kit version' if blob == recorded.get(path) else 'edited'}
                     for path, blob in found.items() if blob or path in recorded]
        journal = (self.target / JOURNAL_DIR).exists()
        return {**self.report(tree, self.describe(tree)), 'journal': journal, 'installed': installed}, EXIT_OK

    @contextlib.contextmanager
    def locked(self):
        """The tree, inspected under the lock after repairing any interrupted run."""
        check_is_yolov9_tree(self.target)
        with tree_lock(self.target):
            restored = restore_from_journal(self.target)
            if restored:
                self.log(f'an earlier run was interrupted; restored {len(restored)} files from its journal')
            yield self.inspect()

    def apply(self, dry_run=False):
        """Apply, or with dry_run check: EXIT_OK if apply would succeed (or has nothing to do), EXIT_MOVED if the tree
        is another upstream revision on which every patch still passes (see drift.PASSES), else EXIT_FAILED."""
        with contextlib.nullcontext(self.inspect()) if dry_run else self.locked() as tree:
            wanted = kit_files()
            try:
                result, edited, reports = self.plan(tree)
                installs = self.install_changes(tree.record, wanted)
            except TreeError as e:
                if not dry_run:
                    raise
                moved = tree.kind == 'modified' and e.drift is not None
                report = self.report(tree, f'would refuse: {e.hint if moved else e}')
                code = EXIT_MOVED if moved and not failing(e.drift) else EXIT_FAILED
                return {**report, **({'drift': e.drift} if e.drift is not None else {})}, code
            changes = {path: data for path, data in result.items() if data != tree.contents.get(path)}
            would, did = self.outcome(tree, changes, installs, edited, reports)
            if dry_run or (tree.kind == 'applied' and tree.record and not changes and not installs):
                report = self.report(tree, would if dry_run else did)
                return {**report, **({'drift': reports} if reports else {})}, EXIT_OK
            self.write(changes, installs, {
                'kit': 'yolov9-ddp', 'version': kit_version(), 'upstream': self.pin.commit, 'series': self.series_id,
                'patches': [p.name for p in self.patches], 'other_revision': reports is not None, 'merged': edited,
                'diff': diff_contents(tree.base, result), 'installed': {p: blob_id(d) for p, d in wanted.items()}})
            return {**self.report(self.inspect(), did), 'installed': sorted(installs)}, EXIT_OK

    def revert(self):
        with self.locked() as tree:
            if tree.kind == 'modified':
                raise TreeError(self.mismatch(tree), 'the kit recorded nothing here to revert: this is another '
                                                     'upstream revision or a copy with edits (--check explains it)')
            if tree.kind in ('pristine', 'edited'):
                return self.report(tree, 'nothing to do: the series is not applied'), EXIT_OK
            base, installs = self.before_kit(tree), self.install_changes(tree.record, {})
            self.write({path: data for path, data in base.items() if data != tree.contents[path]}, installs, None)
            return {**self.report(self.inspect(), 'reverted'), 'removed': sorted(installs)}, EXIT_OK

    # -- helpers -------------------------------------------------------------------------------

    def outcome(self, tree, changes, installs, edited, reports):
        """(what apply would do, what it did) to the tree, in a few words."""
        if tree.kind == 'outdated':
            what = f'the series of kit {tree.kit} taken out, that of kit {kit_version()} applied'
            return f'would upgrade: {what}', f'upgraded: {what}'
        if tree.kind == 'applied' and not changes:
            return (('would update the installed kit files', 'already applied; updated the installed kit files')
                    if installs else ('nothing to do: already applied',) * 2)
        detail = (f', merging your edits in {", ".join(edited)}' if edited else f' to another upstream revision '
                  f'({counts(reports) or "every patch clean"}; recorded)' if reports is not None else '')
        return f'would apply{detail}', f'applied{detail}'

    def describe(self, tree) -> str:
        """The state of the tree in a few words, for --status."""
        if tree.record:
            other = ', to another upstream revision' if tree.record.get('other_revision') else ''
            return f"applied by kit {tree.kit}{other}{'; changed since' * (tree.base is None)}"
        return {'pristine': 'not applied', 'applied': 'applied (no record of the kit: apply installs it)',
                'partial': 'half-applied (by hand): revert takes it out',
                'modified': 'not applied; the touched files differ from the pin (see --check)',
                'edited': 'not applied; apply merges your edits to the touched files'}[tree.kind]

    def report(self, tree, action):
        return {'target': str(self.target), 'repository': self.repository, 'pin': self.pin.commit,
                'state': tree.kind, 'kit': tree.kit, 'action': action, 'files': tree.files,
                'patches': [{'name': p.name, 'status': 'applied' if i < tree.applied else 'not applied'}
                            for i, p in enumerate(self.patches)]}

    def write(self, changes: dict, installs: dict, record):
        """Write changed files, then installed ones (bytes, or None to delete), then the record (None: removed) and
        the entries of .git/info/exclude that keep installed files out of git status, as one journaled change."""
        last = {STATE_FILE: (json.dumps(record, indent=1, sort_keys=True) + '\n').encode() if record else None}
        if self.repository:
            exclude = git(self.target, 'rev-parse', '--git-path', 'info/exclude').stdout.strip()
            old = (self.target / exclude).read_text() if (self.target / exclude).is_file() else ''
            entries = [f'/{name}{"/" * (KIT_ROOT / name).is_dir()}' for name in INSTALLED] + [f'/{STATE_FILE}']
            last.update({exclude: exclude_text(old, entries if record else []).encode()})
        with journaled(self.target, [*changes, *installs, *last]):
            for batch in (changes, installs, last):
                for relative, data in sorted(batch.items(), key=lambda item: (item[1] is None, item[0])):
                    if data is None:
                        remove_file(self.target, relative)
                    else:
                        write_bytes_atomic(self.target / relative, data)

    def install_changes(self, record, wanted) -> dict:
        """{path: bytes, or None to delete} turning the installed kit files into `wanted`; refuses to overwrite or
        delete a file the kit did not install, or one edited since."""
        recorded, changes = record.get('installed', {}), {}
        for relative in sorted(set(recorded) | set(wanted)):
            found, data = file_blob_id(self.target / relative), wanted.get(relative)
            if found == blob_id(data):
                continue
            if found is not None and found != recorded.get(relative):
                if relative in recorded:
                    raise TreeError(f'{relative} was edited after apply_patches.py installed it',
                                    'save your edits elsewhere and restore or delete the file, then run this again')
                raise TreeError(f'{relative} exists in the target and was not installed by this kit',
                                'move it away, then run this command again')
            changes[relative] = data
        return changes
