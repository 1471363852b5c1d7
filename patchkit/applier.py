"""Check, apply, revert and report the patch series on a target tree, all-or-nothing.

Each operation returns a report (a dict, printed as text or JSON by apply_patches.py) and raises
TreeError for anything that stops it; a TreeError always leaves the tree as it was.
"""
import contextlib
import json
from pathlib import Path

from patchkit import drift
from patchkit.gitapply import git_apply, is_repository_root
from patchkit.pin import KIT_ROOT, blob_id, file_blob_id
from patchkit.tree import (STATE_FILE, TreeError, TreeState, check_files, check_is_yolov9_tree, inspect_tree,
                           journaled, read_state, remove_file, restore_from_journal, tree_lock, write_bytes_atomic)

# Kit files installed into the target: the entry point and the package it imports.
INSTALL_SOURCES = ('ddp_train_dual.py', 'yolov9_ddp')

EXIT_OK, EXIT_FAILED, EXIT_MOVED = 0, 1, 3


def kit_files() -> dict:
    """{path relative to the target: bytes} of every kit file the applier installs."""
    files = {}
    for source in INSTALL_SOURCES:
        root = KIT_ROOT / source
        paths = [root] if root.is_file() else sorted(p for p in root.rglob('*') if p.is_file())
        for path in paths:
            if '__pycache__' not in path.parts:
                files[path.relative_to(KIT_ROOT).as_posix()] = path.read_bytes()
    return files


class Applier:
    def __init__(self, target, pin, patches, log=print):
        self.target = Path(target).resolve()
        self.pin, self.patches, self.log = pin, patches, log

    # -- reports -------------------------------------------------------------------------------

    def base_report(self, state):
        return {
            'target': str(self.target),
            'repository': is_repository_root(self.target),
            'pin': self.pin.commit,
            'state': state.kind,
            'patches': [{'name': p.name, 'status': 'applied' if i < state.applied else 'not applied'}
                        for i, p in enumerate(self.patches)],
            'files': [{'path': f.path, 'expected': f.expected, 'found': f.found, 'matches': f.matches}
                      for f in state.files],
        }

    def mismatch_error(self, state):
        """The TreeError for touched files that are neither pinned nor patched."""
        first = state.differing[0]
        others = len(state.differing) - 1
        more = f' (and {others} more file{"s" * (others > 1)})' if others else ''
        if first.found is None:
            return TreeError(f'{first.path} is missing: the series needs it{more}',
                             f'restore it: git checkout {self.pin.short} -- {first.path}')
        cause = (f'{first.path} differs from the pin {self.pin.short}: expected blob {first.expected}, '
                 f'found {first.found}{more}')
        if first.committed is not None and first.committed != first.found:
            return TreeError(cause.replace('differs from the pin', 'has local edits and differs from the pin'),
                             'commit or stash your edits (git stash), then run this command again')
        return TreeError(cause, f'this tree is another upstream revision; check out the pin '
                                f'(git checkout {self.pin.commit}) or see "When upstream moves" in the README')

    # -- operations ----------------------------------------------------------------------------

    def status(self):
        check_is_yolov9_tree(self.target)
        state = inspect_tree(self.target, self.pin, self.patches)
        report = self.base_report(state)
        report['installed'] = self.installed_report()
        report['journal'] = (self.target / '.yolov9-ddp-journal').exists()
        return report, EXIT_OK

    def check(self):
        """Dry run: EXIT_OK if apply would succeed (or has nothing to do), EXIT_MOVED if the tree is another
        upstream revision on which every patch still passes (see drift.PASSES), else EXIT_FAILED.

        Any tree that is neither the pin nor fully applied gets the drift report ('drift': one entry per patch).
        """
        check_is_yolov9_tree(self.target)
        state = inspect_tree(self.target, self.pin, self.patches)
        report = self.base_report(state)
        installs = self.pending_installs()
        if state.kind == 'pristine':
            self.check_series_applies()
            report['action'] = 'would apply'
            return report, EXIT_OK
        if state.kind == 'applied':
            report['action'] = 'would update the installed kit files' if installs else 'nothing to do: already applied'
            return report, EXIT_OK
        report['drift'] = drift.replay_series(self.target, self.patches)
        if state.kind == 'partial':
            report['action'] = 'would refuse: ' + self.partial_message(state)
            if self.may_be_another_revision(state):
                report['action'] += ('; or this is another upstream revision that already contains those fixes '
                                     '(no git history tells the two apart): see the drift report')
            return report, EXIT_FAILED
        failing = [f"{r['name']} ({r['status']})" for r in report['drift'] if not r['passes']]
        if failing:
            report['action'] = 'would refuse: the tree is not the pin and the series does not apply: ' + \
                ', '.join(failing)
            return report, EXIT_FAILED
        moved = [r['status'] for r in report['drift'] if r['status'] != 'clean']
        counts = ', '.join(f'{moved.count(status)} {status}' for status in drift.PASSES if status in moved)
        report['action'] = ('would refuse: the tree is not the pin, though every patch still applies'
                            + (f' ({counts})' if counts else ''))
        return report, EXIT_MOVED

    @contextlib.contextmanager
    def locked_state(self):
        """(state, report) of the tree, inspected under the lock after repairing any interrupted run."""
        check_is_yolov9_tree(self.target)
        with tree_lock(self.target):
            self.recover()
            state = inspect_tree(self.target, self.pin, self.patches)
            yield state, self.base_report(state)

    def apply(self):
        with self.locked_state() as (state, report):
            if state.kind == 'partial':
                hint = 'run apply_patches.py --revert TARGET, then apply again'
                if self.may_be_another_revision(state):
                    hint = (f'if you applied them by hand, {hint}; if this is another upstream revision, see '
                            f'"When upstream moves" in the README')
                raise TreeError(self.partial_message(state), hint)
            if state.kind == 'modified':
                raise self.mismatch_error(state)
            installs = self.pending_installs()
            if state.kind == 'applied' and not installs:
                report['action'] = 'nothing to do: already applied'
                return report, EXIT_OK
            if state.kind == 'pristine':
                self.check_series_applies()  # on a scratch copy first: a damaged patch is named, the tree untouched
            changed = ([f.path for f in state.files] if state.kind == 'pristine' else []) + list(installs)
            with journaled(self.target, changed + [STATE_FILE]):
                if state.kind == 'pristine':
                    result = git_apply(self.target, [p.path for p in self.patches])
                    if not result.ok:
                        raise TreeError(f'git apply failed: {result.first_error}', 'report this as a bug')
                for relative, data in installs.items():
                    write_bytes_atomic(self.target / relative, data)
                self.write_state()
            report.update(self.base_report(TreeState('applied', len(self.patches), check_files(self.target, self.pin))))
            report['installed'] = sorted(installs)
            report['action'] = ('applied' if state.kind == 'pristine'
                                else 'already applied; updated the installed kit files')
            return report, EXIT_OK

    def revert(self):
        with self.locked_state() as (state, report):
            if state.kind == 'modified':
                raise self.mismatch_error(state)
            installed = self.removable_installs()
            if state.kind == 'pristine' and not installed and not (self.target / STATE_FILE).exists():
                report['action'] = 'nothing to do: the tree is already the pin'
                return report, EXIT_OK
            applied = list(reversed(self.patches[:state.applied]))
            with journaled(self.target, [f.path for f in state.files] + installed + [STATE_FILE]):
                if applied:
                    result = git_apply(self.target, [p.path for p in applied], '-R')
                    if not result.ok:
                        raise TreeError(f'git apply -R failed: {result.first_error}', 'report this as a bug')
                for relative in installed + [STATE_FILE]:
                    remove_file(self.target, relative)
            report.update(self.base_report(TreeState('pristine', 0, check_files(self.target, self.pin))))
            report['removed'] = installed
            report['action'] = 'reverted'
            return report, EXIT_OK

    # -- helpers -------------------------------------------------------------------------------

    def check_series_applies(self):
        """On pinned files every patch must apply as written; one that does not is damaged."""
        for report in drift.replay_series(self.target, self.patches):
            if report['status'] != 'clean':
                raise TreeError(f"{report['name']} does not apply to the pinned files: "
                                f"{report.get('detail') or report['status']}",
                                'the patch file is damaged; restore patches/ from the kit repository')

    def recover(self):
        restored = restore_from_journal(self.target)
        if restored:
            self.log(f'an earlier run was interrupted; restored {len(restored)} files from its journal')

    def partial_message(self, state):
        names = [p.name for p in self.patches]
        applied = names[0] if state.applied == 1 else f'{names[0]}..{names[state.applied - 1]}'
        return f'the series is half-applied: {applied} applied, {names[state.applied]}.. not'

    @staticmethod
    def may_be_another_revision(state) -> bool:
        """Whether a 'partial' tree may be another upstream revision: only a git repository whose HEAD holds
        the pinned files proves that the prefix of the series was applied on top of the pin."""
        return not all(f.committed == f.expected for f in state.files)

    def pending_installs(self) -> dict:
        """Kit files whose installed copy is missing or differs; refuses to overwrite files it did not install."""
        recorded = read_state(self.target).get('installed', {})
        pending = {}
        for relative, data in kit_files().items():
            found = file_blob_id(self.target / relative)
            if found == blob_id(data):
                continue
            if found is not None and recorded.get(relative) != found:
                raise TreeError(f'{relative} exists in the target and was not installed by this kit',
                                'move it away, then run this command again')
            pending[relative] = data
        return pending

    def removable_installs(self) -> list:
        """Installed kit files to delete on revert; refuses when one was edited after installation."""
        recorded = read_state(self.target).get('installed', {})
        removable = []
        for relative, blob in sorted(recorded.items()):
            found = file_blob_id(self.target / relative)
            if found is None:
                continue
            if found != blob:
                raise TreeError(f'{relative} was edited after apply_patches.py installed it',
                                'save your edits elsewhere and restore or delete the file, then revert again')
            removable.append(relative)
        return removable

    def installed_report(self):
        recorded = read_state(self.target).get('installed', {})
        current = {k: blob_id(v) for k, v in kit_files().items()}
        report = []
        for relative in sorted(set(recorded) | set(current)):
            found = file_blob_id(self.target / relative)
            status = ('missing' if found is None else 'current' if found == current.get(relative)
                      else 'edited' if found != recorded.get(relative) else 'older kit version')
            report.append({'path': relative, 'status': status})
        return report

    def write_state(self):
        state = {'kit': 'yolov9-ddp', 'upstream': self.pin.commit, 'patches': [p.name for p in self.patches],
                 'installed': {relative: blob_id(data) for relative, data in kit_files().items()}}
        write_bytes_atomic(self.target / STATE_FILE, (json.dumps(state, indent=1, sort_keys=True) + '\n').encode())
