"""apply_patches.py and the patch series: the pin, the patch files, apply/check/status/revert, bad input,
git clones, the maintainers' refresh round trip and crash safety.

Every test works on its own copy of the pinned upstream and runs apply_patches.py as a subprocess,
the way a user runs it. "Unchanged" means snapshot() equal: the same listing and the same bytes.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock

from patchkit.pin import Pin, blob_id, file_blob_id
from patchkit.refresh import apply_as_commits, refresh
from patchkit.series import read_series
from patchkit.tree import JOURNAL_DIR as JOURNAL, STATE_FILE, lock_path
from testsupport.trees import (KIT, PATCHES, SERIES, apply_ok, clean_env, copy_kit, copy_tree, describe, git,
                               make_git_repo, run_applier, snapshot)


# -- helpers -------------------------------------------------------------------------------------

def kit_install_files() -> dict:
    """{path in the target: bytes} the applier must install: ddp_train_dual.py (when the kit has it)
    and every file of the yolov9_ddp package. Listed here independently of patchkit.applier."""
    files = {}
    if (KIT / 'ddp_train_dual.py').is_file():
        files['ddp_train_dual.py'] = (KIT / 'ddp_train_dual.py').read_bytes()
    for path in sorted((KIT / 'yolov9_ddp').rglob('*')):
        if path.is_file() and '__pycache__' not in path.parts and path.suffix != '.pyc':
            files[path.relative_to(KIT).as_posix()] = path.read_bytes()
    return files


def status_json(tree: Path) -> dict:
    result = run_applier(tree, '--status', '--json')
    assert result.returncode == 0, describe(result)
    return json.loads(result.stdout)


def assert_pinned(tree: Path, pinned_upstream: Path):
    """tree is the pinned upstream again: the same listing and the same bytes."""
    assert snapshot(tree) == snapshot(pinned_upstream)


def target_state(target: Path):
    """What assert_refused compares: a folder's snapshot, a file's bytes, or None when absent."""
    if not target.exists():
        return None
    return snapshot(target) if target.is_dir() else target.read_bytes()


def assert_refused(result, before, target: Path, *facts, hint=None):
    """A clean refusal: non-zero exit, a one-line cause first on stderr naming the facts, no traceback,
    and the target exactly as it was."""
    assert result.returncode == 1, describe(result)
    lines = result.stderr.splitlines()
    assert lines and lines[0].startswith('apply_patches.py: error: '), describe(result)
    for fact in facts:
        assert fact in lines[0], f'{fact!r} is not in the error line {lines[0]!r}'
    if hint:
        assert len(lines) > 1 and lines[1].startswith('apply_patches.py: hint: ') and hint in lines[1], \
            describe(result)
    assert 'Traceback' not in result.stderr, describe(result)
    assert target_state(target) == before, 'the refused run changed the target'


def apply_first_patches(tree: Path, count: int):
    git(tree, 'apply', *(str(PATCHES / name) for name in SERIES[:count]))  # plain git, not the kit's code


# -- the pin and the patch files -----------------------------------------------------------------

def test_the_pin_is_named_only_in_patches_upstream(pin):
    tracked = subprocess.run(['git', 'ls-files', '-z'], cwd=str(KIT), capture_output=True, env=clean_env(),
                             check=True).stdout.decode().split('\0')
    assert 'patches/UPSTREAM' in tracked
    assert re.fullmatch(r'[0-9a-f]{40}', pin.commit)
    assert pin.commit in (PATCHES / 'UPSTREAM').read_text()
    offenders = []
    for name in filter(None, tracked):
        path = KIT / name
        if name == 'patches/UPSTREAM' or not path.is_file():
            continue
        data = path.read_bytes()
        if b'\0' in data:  # binary
            continue
        # the short form as a word of its own: inside a 40-hex blob id it would be a coincidence, not a pin
        if pin.commit.encode() in data or re.search(rb'\b%s\b' % pin.short.encode(), data):
            offenders.append(name)
    assert offenders == [], f'the pinned commit is named outside patches/UPSTREAM in {offenders}'


def test_series_lists_one_numbered_patch_file_each_with_a_dep3_header():
    assert SERIES, 'patches/series lists no patches'
    assert sorted(p.name for p in PATCHES.glob('*.patch')) == sorted(SERIES), 'patch files and series disagree'
    for number, name in enumerate(SERIES, 1):
        assert re.fullmatch(rf'{number:04d}-[a-z0-9]+(-[a-z0-9]+)*\.patch', name), f'{name} is not patch {number}'
        text = (PATCHES / name).read_text()
        header = text[:text.index('\ndiff --git ')]
        fields = dict(re.findall(r'(?m)^([A-Z][A-Za-z-]*): (.+)$', header))
        assert header.startswith('Description: '), f'{name} does not open with its Description'
        assert fields.get('Description', '').strip(), name
        assert re.match(r'(Pending|Submitted|Accepted|Backport|Not-Needed|Inappropriate)\b',
                        fields.get('Upstream-Status', '')), f'{name}: bad Upstream-Status'
        assert re.fullmatch(r'\d{4}-\d{2}-\d{2}', fields.get('Last-Update', '')), f'{name}: bad Last-Update'


def diff_sections(patch: Path):
    """(path, old blob, new blob, creates the file) for each file section of a patch's diff."""
    text = patch.read_text()
    for section in filter(None, re.split(r'(?m)^(?=diff --git )', text[text.index('\ndiff --git ') + 1:])):
        path = re.match(r'diff --git a/(\S+) b/', section).group(1)
        old, new = re.search(r'(?m)^index ([0-9a-f]{40})\.\.([0-9a-f]{40})', section).groups()
        yield path, old, new, bool(re.search(r'(?m)^new file mode ', section))


def test_upstream_touched_section_is_exactly_what_the_series_modifies(pin, pinned_upstream):
    # Read the diffs themselves: every file they modify and the blob id the first patch expects to find.
    pinned_by_series, current = {}, {}
    for name in SERIES:
        for path, old, new, creates in diff_sections(PATCHES / name):
            if creates:
                continue
            if path in current:  # a later patch must meet the file as the earlier ones left it
                assert current[path] == old, f'{name} expects {path} at blob {old}, the series leaves {current[path]}'
            else:
                pinned_by_series[path] = old
            current[path] = new
    assert pin.touched == pinned_by_series
    assert {path: file_blob_id(pinned_upstream / path) for path in pin.touched} == pin.touched


# -- apply, again, revert, check, status, json ---------------------------------------------------

def test_apply_patches_every_touched_file_and_installs_the_kit(pin, pristine_tree):
    result = apply_ok(pristine_tree)
    assert 'applied' in result.stdout
    unchanged = [path for path, blob in pin.touched.items() if file_blob_id(pristine_tree / path) == blob]
    assert unchanged == [], f'apply left these touched files as pinned: {unchanged}'
    installs = kit_install_files()
    assert 'yolov9_ddp/demo_data.py' in installs
    for relative, data in installs.items():
        assert (pristine_tree / relative).read_bytes() == data, f'{relative} is not installed as in the kit'
    state = json.loads((pristine_tree / STATE_FILE).read_text())
    assert state['upstream'] == pin.commit and state['patches'] == SERIES
    assert not (pristine_tree / JOURNAL).exists()
    report = status_json(pristine_tree)
    assert report['state'] == 'applied'
    assert all(p['status'] == 'applied' for p in report['patches'])


def test_apply_twice_changes_nothing_the_second_time(pristine_tree):
    apply_ok(pristine_tree)
    before = snapshot(pristine_tree, modes=True)
    result = apply_ok(pristine_tree)
    assert 'nothing to do: already applied' in result.stdout
    assert snapshot(pristine_tree, modes=True) == before


def test_revert_restores_the_pinned_bytes_and_removes_the_kit(pristine_tree, pinned_upstream):
    apply_ok(pristine_tree)
    result = apply_ok(pristine_tree, '--revert')
    assert 'reverted' in result.stdout
    assert snapshot(pristine_tree, modes=True) == snapshot(pinned_upstream, modes=True)
    result = apply_ok(pristine_tree, '--revert')
    assert 'nothing to do' in result.stdout


def test_check_exit_status_follows_the_documented_contract(pristine_tree):
    # Docstring of apply_patches.py: 0 apply would succeed or nothing to do, 1 refused,
    # 3 (--check only) another upstream revision where every patch still applies.
    def check(expected_code, *phrases):
        before = snapshot(pristine_tree)
        result = run_applier(pristine_tree, '--check')
        assert result.returncode == expected_code, describe(result)
        for phrase in phrases:
            assert phrase in result.stdout, describe(result)
        assert snapshot(pristine_tree) == before, '--check changed the tree'

    check(0, 'would apply')
    apply_ok(pristine_tree)
    check(0, 'nothing to do: already applied')
    apply_ok(pristine_tree, '--revert')

    metrics = pristine_tree / 'utils' / 'metrics.py'
    pinned_text = metrics.read_text()
    metrics.write_text('# two lines inserted at the top\n# move every hunk of 0006 down\n' + pinned_text)
    check(3, 'every patch still applies', 'ok (offset)')

    integrate = 'ap = np.trapz(np.interp(x, mrec, mpre), x)  # integrate\n'  # a line patch 0006 changes
    assert pinned_text.count(integrate) == 1
    metrics.write_text(pinned_text.replace(integrate, integrate.replace('# integrate', '# integrate (edited)')))
    check(1, 'does not apply', 'CONFLICT', 'utils/metrics.py')


def test_status_reports_patches_and_installed_files(pin, pristine_tree):
    result = apply_ok(pristine_tree, '--status')
    # a clean tree says so plainly: one line "not applied", a row per patch, no list of missing kit files
    assert result.stdout.splitlines()[0].endswith(f': pristine (pin {pin.short}); not applied'), describe(result)
    for name in SERIES:
        assert re.search(rf'(?m)^\s+{re.escape(name)}\s+not applied$', result.stdout), describe(result)
    assert 'installed' not in result.stdout and len(result.stdout.splitlines()) == 1 + len(SERIES)
    apply_ok(pristine_tree)
    result = apply_ok(pristine_tree, '--status')
    assert 'applied' in result.stdout.splitlines()[0]
    for name in SERIES:
        assert re.search(rf'(?m)^\s+{re.escape(name)}\s+applied$', result.stdout), describe(result)
    for relative in kit_install_files():
        assert f'installed {relative}: current' in result.stdout


@pytest.mark.parametrize('args', [('--status',), ('--check',), ()], ids=['status', 'check', 'apply'])
def test_json_output_has_one_entry_per_patch(pristine_tree, args):
    result = run_applier(pristine_tree, *args, '--json')
    assert result.returncode == 0, describe(result)
    report = json.loads(result.stdout)  # stdout holds nothing but the JSON document
    assert [p['name'] for p in report['patches']] == SERIES
    assert report['ok'] is True
    assert report['state'] == ('applied' if not args else 'pristine')


def test_json_output_of_a_refusal(pristine_tree):
    with open(pristine_tree / 'utils' / 'general.py', 'a') as f:
        f.write('# edited\n')
    result = run_applier(pristine_tree, '--json')
    assert result.returncode == 1, describe(result)
    report = json.loads(result.stdout)
    assert report['ok'] is False and 'utils/general.py' in report['error'] and report['hint']


# -- git clones and vendored trees ---------------------------------------------------------------

def test_apply_and_revert_in_a_git_clone_with_unrelated_local_commits(pin, pristine_tree):
    make_git_repo(pristine_tree)
    with open(pristine_tree / 'detect.py', 'a') as f:  # a pinned file the series does not touch
        f.write('# a local change of this clone\n')
    (pristine_tree / 'NOTES.md').write_text('local notes\n')
    git(pristine_tree, 'add', '--all')
    git(pristine_tree, 'commit', '--quiet', '--no-verify', '-m', 'unrelated local work')
    committed = snapshot(pristine_tree)

    result = run_applier(pristine_tree, '--json')
    assert result.returncode == 0, describe(result)
    assert json.loads(result.stdout)['repository'] is True  # seen as a git clone
    assert all(file_blob_id(pristine_tree / path) != blob for path, blob in pin.touched.items())
    assert status_json(pristine_tree)['state'] == 'applied'

    apply_ok(pristine_tree, '--revert')
    assert snapshot(pristine_tree) == committed
    assert git(pristine_tree, 'status', '--porcelain') == ''


def test_apply_in_a_tree_vendored_inside_another_repository(pin, pinned_upstream, tmp_path):
    outer = tmp_path / 'project'
    tree = copy_tree(pinned_upstream, outer / 'third_party' / 'yolov9')
    (outer / 'README.md').write_text('a project that vendors YOLOv9\n')
    make_git_repo(outer)
    apply_ok(tree)
    assert all(file_blob_id(tree / path) != blob for path, blob in pin.touched.items())
    assert status_json(tree)['state'] == 'applied'
    apply_ok(tree, '--revert')
    assert_pinned(tree, pinned_upstream)


# -- the maintainers' round trip -----------------------------------------------------------------

def upstream_text_for(pin, commit: str, present) -> str:
    """The kit's patches/UPSTREAM as a refresh from `commit` must write it: the commit line replaced,
    and without the lines of pinned files the clone lacks (a rebuilt tree has no images)."""
    lines = []
    for line in (PATCHES / 'UPSTREAM').read_text().splitlines(keepends=True):
        if line == f'commit {pin.commit}\n':
            line = f'commit {commit}\n'
        match = re.fullmatch(r'[0-9a-f]{40} (\S+)\n', line)
        if match and match.group(1) not in present:
            continue
        lines.append(line)
    return ''.join(lines)


def refresh_round_trip(clone: Path, pin_for_clone: Pin, patch_dir: Path):
    """--commits then --refresh (twice) into patch_dir; returns snapshots after each refresh."""
    apply_as_commits(clone, pin_for_clone, read_series(), log=lambda msg: None)
    written = []
    for _ in range(2):
        refresh(clone, pin_for_clone, patch_dir=patch_dir, log=lambda msg: None)
        written.append({p.name: p.read_bytes() for p in sorted(patch_dir.iterdir())})
    return written


def test_refresh_regenerates_the_series_byte_for_byte(pin, pinned_upstream, tmp_path):
    # The real pinned commit cannot be recreated offline, so the clone's root commit holds the pinned
    # tree and stands in for it: the patches and series must still come out identical.
    clone = copy_tree(pinned_upstream, tmp_path / 'clone')
    root_commit = make_git_repo(clone)
    stand_in = Pin(pin.repository, root_commit, pin.touched, pin.tree)
    patch_dir = tmp_path / 'patches'
    patch_dir.mkdir()
    (patch_dir / '0011-stale.patch').write_text('a patch the commits no longer have\n')

    first, second = refresh_round_trip(clone, stand_in, patch_dir)
    assert second == first, 'a second refresh rewrote different bytes'
    # patches/previous/ holds what earlier kit versions applied: kit data that no refresh writes
    kit = {p.name: p.read_bytes() for p in PATCHES.iterdir() if p.is_file() and p.name != 'UPSTREAM'}
    assert {name: data for name, data in first.items() if name != 'UPSTREAM'} == kit
    present = {path for path in pin.all_blobs if (clone / path).is_file()}
    assert first['UPSTREAM'].decode() == upstream_text_for(pin, root_commit, present)


def test_refresh_refuses_a_clone_without_the_pin(pinned_upstream, tmp_path):
    kit = copy_kit(tmp_path / 'kit')  # --refresh writes into the kit's patches/: never risk the real one
    clone = copy_tree(pinned_upstream, tmp_path / 'clone')
    make_git_repo(clone)
    for option in ('--refresh', '--commits'):
        before = snapshot(clone), snapshot(kit)
        result = run_applier(None, option, str(clone), kit=kit)
        assert result.returncode == 1, describe(result)
        assert result.stderr.startswith('apply_patches.py: error: ') and 'does not contain the pinned commit' in \
            result.stderr.splitlines()[0], describe(result)
        assert 'Traceback' not in result.stderr
        assert (snapshot(clone), snapshot(kit)) == before


# -- bad input -----------------------------------------------------------------------------------

def test_refuses_a_missing_path(tmp_path):
    target = tmp_path / 'no-such-folder'
    assert_refused(run_applier(target), None, target, str(target), 'does not exist')


def test_refuses_a_file(tmp_path):
    target = tmp_path / 'train_dual.py'
    target.write_text('print("not a tree")\n')
    assert_refused(run_applier(target), target_state(target), target, str(target), 'is not a folder')


def test_refuses_a_folder_that_is_not_a_yolov9_tree(tmp_path):
    target = tmp_path / 'project'
    (target / 'utils').mkdir(parents=True)
    (target / 'train.py').write_text('')
    assert_refused(run_applier(target), target_state(target), target, 'is not a YOLOv9 tree', 'train_dual.py')


def test_refuses_a_touched_file_that_differs_from_the_pin(pin, pristine_tree):
    general = pristine_tree / 'utils' / 'general.py'
    with open(general, 'a') as f:
        f.write('# edited\n')
    before = snapshot(pristine_tree)
    assert_refused(run_applier(pristine_tree), before, pristine_tree, 'utils/general.py',
                   pin.touched['utils/general.py'], blob_id(general.read_bytes()), hint='check out the pin')


def test_local_edits_in_a_git_clone_are_merged_and_given_back(pristine_tree):
    # Refusing ("commit or stash your edits") would be a dead end: after stash and apply, `git stash pop` conflicts.
    # The clone holds the pinned blobs, so the edit is merged in (the cases: tests/test_clone.py).
    make_git_repo(pristine_tree)
    general = pristine_tree / 'utils' / 'general.py'
    with open(general, 'a') as f:
        f.write('# work in progress\n')
    edited = general.read_bytes()
    result = apply_ok(pristine_tree)
    assert 'applied, merging your edits in utils/general.py' in result.stdout, describe(result)
    assert general.read_text().endswith('# work in progress\n') and general.read_bytes() != edited
    apply_ok(pristine_tree, '--revert')
    assert general.read_bytes() == edited


def test_refuses_a_half_applied_series_and_reverts_it(pristine_tree, pinned_upstream):
    apply_first_patches(pristine_tree, 3)
    before = snapshot(pristine_tree)
    assert_refused(run_applier(pristine_tree), before, pristine_tree, 'half-applied', SERIES[0], SERIES[2],
                   SERIES[3], hint='--revert')
    apply_ok(pristine_tree, '--revert')
    assert_pinned(pristine_tree, pinned_upstream)


def test_refuses_a_corrupt_patch_file_and_names_it(pristine_tree, tmp_path):
    kit = copy_kit(tmp_path / 'kit')
    damaged = SERIES[3]  # a patch in the middle of the series: the ones before it are fine
    data = (kit / 'patches' / damaged).read_bytes()
    (kit / 'patches' / damaged).write_bytes(data[:len(data) * 2 // 3])  # cut off inside a hunk
    before = snapshot(pristine_tree)
    assert_refused(run_applier(pristine_tree, kit=kit), before, pristine_tree, damaged)


def test_refuses_a_patch_file_without_its_dep3_header(pristine_tree, tmp_path):
    kit = copy_kit(tmp_path / 'kit')
    damaged = kit / 'patches' / SERIES[1]
    damaged.write_text(re.sub(r'(?m)^Upstream-Status: .*\n', '', damaged.read_text()))
    before = snapshot(pristine_tree)
    assert_refused(run_applier(pristine_tree, kit=kit), before, pristine_tree, SERIES[1], 'Upstream-Status')


@pytest.mark.parametrize('damage, facts', [
    (lambda text: text.replace('\ncommit ', '\ncommitted ', 1), ['UPSTREAM:', 'cannot parse', 'committed']),
    (lambda text: re.sub(r'(?m)^commit .*\n', '', text), ['UPSTREAM', 'missing commit']),
], ids=['a-line-it-cannot-parse', 'no-commit'])
def test_refuses_a_damaged_pin_file_and_says_what_is_wrong(pristine_tree, tmp_path, damage, facts):
    kit = copy_kit(tmp_path / 'kit')
    pin_file = kit / 'patches' / 'UPSTREAM'
    pin_file.write_text(damage(pin_file.read_text()))
    before = snapshot(pristine_tree)
    assert_refused(run_applier(pristine_tree, kit=kit), before, pristine_tree, *facts)


def test_refuses_while_another_applier_holds_the_tree(pristine_tree, monkeypatch):
    before = snapshot(pristine_tree)
    monkeypatch.setattr(tempfile, 'tempdir', str(pristine_tree.parent))  # the applier's TMPDIR (run_applier)
    with FileLock(str(lock_path(pristine_tree.resolve()))):  # the lock an apply_patches.py run holds
        result = run_applier(pristine_tree)
    assert_refused(result, before, pristine_tree, 'another apply_patches.py is working')


def test_refuses_in_one_line_when_another_account_left_the_lock(pristine_tree, tmp_path, monkeypatch):
    # Two accounts applying to one shared tree share a lock file in the temporary folder; filelock will not take
    # one that another account owns in a sticky folder such as /tmp. (The test runs as root, as CI does.)
    shared_tmp = tmp_path / 'shared-tmp'
    shared_tmp.mkdir()
    shared_tmp.chmod(0o1777)  # sticky and writable by all, as /tmp (mkdir's mode would pass through the umask)
    monkeypatch.setattr(tempfile, 'tempdir', str(shared_tmp))
    lock = lock_path(pristine_tree.resolve())
    lock.touch()
    os.chown(lock, 65534, 65534)  # nobody's
    before = snapshot(pristine_tree)
    result = run_applier(pristine_tree, env=clean_env(TMPDIR=str(shared_tmp)))
    assert_refused(result, before, pristine_tree, f'cannot take the lock {lock}', 'uid 65534', hint='as that account')


# -- file modes ----------------------------------------------------------------------------------

def test_a_failed_apply_leaves_file_modes_as_they_were(pristine_tree, tmp_path):
    # The docstring promises "the tree is left as it was": permission bits included.
    kit = copy_kit(tmp_path / 'kit')
    first = kit / 'patches' / SERIES[0]
    first.write_bytes(first.read_bytes()[:-200])  # the first patch: nothing is applied before it fails
    before = snapshot(pristine_tree, modes=True)
    result = run_applier(pristine_tree, kit=kit)
    assert result.returncode == 1 and SERIES[0] in result.stderr, describe(result)
    after = snapshot(pristine_tree, modes=True)
    changed = {path: (oct(before[path][1]), oct(after[path][1])) for path in before
               if path in after and before[path][1] != after[path][1]}
    assert changed == {}, f'the failed apply changed permission bits (before, after): {changed}'
    assert snapshot(pristine_tree) == {path: value for path, (value, _) in before.items()}  # the bytes are back


def test_installed_kit_files_get_the_usual_file_mode(pristine_tree):
    # Anyone who can read the tree must be able to read (and run) the installed kit, as with upstream's files.
    probe = pristine_tree / 'mode-probe'
    probe.write_text('')
    usual = probe.stat().st_mode & 0o777
    probe.unlink()
    apply_ok(pristine_tree)
    modes = {relative: oct((pristine_tree / relative).stat().st_mode & 0o777) for relative in kit_install_files()}
    assert modes == {relative: oct(usual) for relative in modes}, 'installed kit files are not created like others'


# -- crash safety --------------------------------------------------------------------------------

# Runs apply_patches.main() with one function of patchkit.applier wrapped so that the process gets a
# signal right after the function's first call: inside the journaled block, once the tree has started to change.
SIGNAL_DRIVER = '''
import os, signal, sys
sys.path.insert(0, {kit!r})
import patchkit.applier as applier
real = getattr(applier, {function!r})
def call_then_signal(*args, **kwargs):
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.{signal})
setattr(applier, {function!r}, call_then_signal)
import apply_patches
sys.exit(apply_patches.main({argv!r}))
'''


def signal_inside(tree: Path, function: str, signal_name: str, *args) -> subprocess.CompletedProcess:
    code = SIGNAL_DRIVER.format(kit=str(KIT), function=function, signal=signal_name, argv=[str(tree), *args])
    return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300,
                          env=clean_env(TMPDIR=str(tree.parent)))  # as run_applier: the lock file beside the tree


def kill_inside(tree: Path, function: str, *args):
    result = signal_inside(tree, function, 'SIGKILL', *args)
    assert result.returncode == -signal.SIGKILL, describe(result)
    assert (tree / JOURNAL).is_dir(), 'the driver died outside the journaled block'
    assert status_json(tree)['journal'] is True


def test_an_apply_stopped_by_sigterm_puts_the_tree_back_itself(pristine_tree, pinned_upstream):
    result = signal_inside(pristine_tree, 'write_bytes_atomic', 'SIGTERM')
    assert result.returncode == 130, describe(result)
    assert result.stderr.startswith('apply_patches.py: interrupted; the tree is as it was'), describe(result)
    assert 'Traceback' not in result.stderr
    assert_pinned(pristine_tree, pinned_upstream)  # no journal, no state file, no kit file, pinned bytes


def test_an_apply_killed_half_way_is_undone_by_the_next_run(pin, pristine_tree, pinned_upstream):
    kill_inside(pristine_tree, 'write_bytes_atomic')  # after git apply and the first installed kit file
    assert any(file_blob_id(pristine_tree / path) != blob for path, blob in pin.touched.items())

    result = apply_ok(pristine_tree)
    assert re.search(r'an earlier run was interrupted; restored \d+ files from its journal', result.stdout), \
        describe(result)
    assert not (pristine_tree / JOURNAL).exists()
    assert status_json(pristine_tree)['state'] == 'applied'
    for relative, data in kit_install_files().items():
        assert (pristine_tree / relative).read_bytes() == data

    apply_ok(pristine_tree, '--revert')
    assert_pinned(pristine_tree, pinned_upstream)


def test_a_revert_killed_half_way_is_undone_by_the_next_run(pin, pristine_tree, pinned_upstream):
    apply_ok(pristine_tree)
    kill_inside(pristine_tree, 'remove_file', '--revert')  # after reverse-applying, at the first removal
    assert any(file_blob_id(pristine_tree / path) == blob for path, blob in pin.touched.items())

    result = apply_ok(pristine_tree, '--revert')
    assert 'an earlier run was interrupted' in result.stdout, describe(result)
    assert not (pristine_tree / JOURNAL).exists()
    assert_pinned(pristine_tree, pinned_upstream)
