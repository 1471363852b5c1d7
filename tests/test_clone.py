"""apply_patches.py on the user's own clone: local edits (committed or not) merged around, a conflicting edit
refused, another upstream revision behind --allow-other-revision, trees patched by earlier kit versions upgraded
or reverted, installed files kept out of git status, git read in English whatever the locale, and no POSIX-only
import in the applier.

Every clone is a git repository made from the verified pinned tree, as `git clone` of upstream gives it (its
commit on origin/main); the user's own commits are local, upstream's new ones move origin/main. Every refusal
must leave the tree, the index and HEAD exactly as they were, and every applied tree must revert to exactly
what the user had.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testsupport.trees import (KIT, PATCHES, SERIES, apply_ok, clean_env, commit_upstream, copy_kit, copy_tree,
                               describe, git, make_git_repo, patch_files, run_applier, run_python, snapshot)

STATE = '.yolov9-ddp.json'
# A custom block in models/common.py, the edit users make most: a module of their own between two of upstream's.
ANCHOR = 'class ImplicitA(nn.Module):\n'
CUSTOM_BLOCK = ('class MyAttention(nn.Module):\n    # a module of my own, used by my model yaml\n'
                '    def forward(self, x):\n        return x\n\n\n')
IPYTHON_IMPORT = 'from IPython.display import display\n'  # a line patch 0002 changes (hunk 1)
METRICS_INTEGRATE = 'ap = np.trapz(np.interp(x, mrec, mpre), x)  # integrate\n'  # a line patch 0006 changes
METRICS_CONTEXT = "    method = 'interp'  # methods: 'continuous', 'interp'\n"  # a context line of 0006's hunk
# The touched files as kit 0.1.0 left them (the last `index` line of each file in its patches): proves that
# patches/previous/kit-0.1.0.diff is the series that kit applied.
KIT_0_1_0_FILES = {
    'models/common.py': '9c234bb31d7a2a2a1926efc057aca08e824ac615',
    'models/experimental.py': 'a5ddfd2a13cd02a6c2f72f6d7bd3970111bc018f',
    'train_dual.py': 'c691211637bc5a22a53bb2a1dfb02e982ce13d14',
    'utils/autobatch.py': 'fe00e76a9a8418ba048f36d43e647fdf6d9b28ae',
    'utils/dataloaders.py': '89c327f4719bc24d01f7d4c97bab82f732c0b4db',
    'utils/general.py': 'e3055f4396b9f3e522bd03391ce98a7bb5221816',
    'utils/loggers/__init__.py': 'b946d3ef0d66af53000f5ad325d9a4edbc260ff3',
    'utils/loss_tal_dual.py': 'bb0ef1c47039a9965c69937232dc165994f58fda',
    'utils/metrics.py': '68a807575fc7b19436eabb755ca33a178e952cb2',
    'utils/plots.py': 'f72388ad5d97f942f192d9babc8654edf7469b35',
    'val_dual.py': 'e8dd4d0fd7195c091df438ccc367f9fb8ae8d7d4',
}


# -- helpers -------------------------------------------------------------------------------------

def fingerprint(repo: Path):
    """Everything a refusal must leave alone: the files and, in a git repository, the index, HEAD and what git
    status says."""
    if not (repo / '.git').exists():
        return snapshot(repo, modes=True)
    return (snapshot(repo, modes=True), git(repo, 'rev-parse', 'HEAD'), git(repo, 'ls-files', '--stage'),
            git(repo, 'status', '--porcelain', '--untracked-files=all'))


def refused(repo: Path, *args, kit=KIT) -> list:
    """The applier refuses, leaving everything as it was; returns its (error, hint) lines."""
    before = fingerprint(repo)
    result = run_applier(repo, *args, kit=kit)
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and lines[0].startswith('apply_patches.py: error: '), describe(result)
    assert 'Traceback' not in result.stderr and fingerprint(repo) == before, describe(result)
    return lines


def edit(path: Path, old: str, new: str):
    text = path.read_text()
    assert text.count(old) == 1, f'{old!r} is not once in {path}'
    path.write_text(text.replace(old, new))


def commit_local(repo: Path, message: str):
    """A commit of the user's own: on the local branch only."""
    git(repo, 'commit', '--quiet', '--no-verify', '--all', '-m', message)


def plainly_patched(tree: Path, tmp_path: Path, name: str) -> Path:
    """A copy of tree with the series applied by plain `git apply` (no kit code), to compare against."""
    copy = copy_tree(tree, tmp_path / name)
    git(copy, 'apply', *(str(PATCHES / patch) for patch in SERIES))
    return copy


def assert_works(tree: Path, env: dict, *custom):
    """The patched tree imports: upstream's modules as merged or moved, the user's own classes, the kit's entry."""
    code = 'import sys, models.common, utils.general, utils.metrics, val_dual, ddp_train_dual\n' \
           'assert all(hasattr(models.common, name) for name in sys.argv[1:])'
    result = run_python(code, tree, env, args=custom)
    assert result.returncode == 0, describe(result)


def touched_bytes(tree: Path, pin) -> dict:
    return {path: (tree / path).read_bytes() for path in pin.touched}


@pytest.fixture
def clone(pristine_tree) -> Path:
    """A clone of the pinned upstream (no local commits, no edits)."""
    make_git_repo(pristine_tree)
    return pristine_tree


# -- local edits ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
@pytest.mark.parametrize('committed', [False, True], ids=['uncommitted', 'committed'])
def test_a_custom_block_in_models_common_is_merged_in_and_given_back(pin, clone, tmp_path, offline_env, committed):
    common = clone / 'models' / 'common.py'
    edit(common, ANCHOR, CUSTOM_BLOCK + ANCHOR)
    if committed:
        commit_local(clone, 'my attention block')
    edited, before = common.read_bytes(), fingerprint(clone)
    # the series' change and the user's block, both: what plain git apply gives on the edited file, as the block
    # is far from every hunk
    expected = plainly_patched(clone, tmp_path, 'expected')

    check = apply_ok(clone, '--check')
    assert 'would apply, merging your edits in models/common.py' in check.stdout, describe(check)
    result = apply_ok(clone)
    assert 'applied, merging your edits in models/common.py' in result.stdout, describe(result)
    assert touched_bytes(clone, pin) == touched_bytes(expected, pin)
    assert CUSTOM_BLOCK in common.read_text()
    assert git(clone, 'diff', '--cached', '--name-only') == ''  # the index is the user's, untouched
    assert json.loads((clone / STATE).read_text())['merged'] == ['models/common.py']
    assert 'nothing to do' in apply_ok(clone).stdout
    assert_works(clone, offline_env, 'MyAttention')

    apply_ok(clone, '--revert')
    assert common.read_bytes() == edited and fingerprint(clone) == before


def test_an_edit_that_conflicts_with_a_patch_is_refused_naming_file_patch_and_hunk(pin, clone):
    common = clone / 'models' / 'common.py'
    mine = '# from IPython.display import display  (no IPython on my machine)\n'
    edit(common, IPYTHON_IMPORT, mine)
    line = common.read_text().splitlines().index(mine.rstrip('\n')) + 1
    patch = next(name for name in SERIES if 'ipython' in name)

    error, hint = refused(clone)
    assert f'models/common.py: your edit at line {line} conflicts with hunk 1 of {patch}' in error, error
    assert 'undo it, apply, then make it again' in hint and 'unchanged' in hint
    check = run_applier(clone, '--check', '--json')
    assert check.returncode == 1 and json.loads(check.stdout)['action'].startswith('would refuse: models/common.py')
    assert 'nothing to do: the series is not applied' in apply_ok(clone, '--revert').stdout


def test_edits_made_after_apply_are_kept_by_revert_or_refused_when_they_touch_a_patched_line(clone):
    before = fingerprint(clone)
    apply_ok(clone)
    metrics = clone / 'utils' / 'metrics.py'
    metrics.write_text('# my note, written after apply\n' + metrics.read_text())  # far from the patched lines
    apply_ok(clone, '--revert')
    assert metrics.read_text().startswith('# my note') and git(clone, 'diff', '--stat').count('|') == 1
    metrics.write_text(metrics.read_text().replace('# my note, written after apply\n', ''))
    assert fingerprint(clone) == before

    apply_ok(clone)
    patch = (PATCHES / next(name for name in SERIES if name.startswith('0006'))).read_text()
    written = next(line[1:] for line in patch.splitlines() if line.startswith('+') and line[1:].strip()
                   and not line.startswith('+++') and metrics.read_text().count(line[1:] + '\n') == 1)
    edit(metrics, written + '\n', written + '  # mine\n')  # on a line the series wrote
    error, hint = refused(clone, '--revert')
    assert 'utils/metrics.py was changed after kit' in error and 'undo that change' in hint, error
    assert refused(clone)[0] == error


def test_a_user_commit_that_merged_a_patch_by_hand_is_merged_too(pin, pinned_upstream, clone, tmp_path):
    git(clone, 'apply', str(PATCHES / SERIES[0]))  # "pin + 0001" committed in the clone: the user's own fix
    commit_local(clone, 'fix pkg_resources myself')
    before = fingerprint(clone)
    apply_ok(clone)
    assert touched_bytes(clone, pin) == touched_bytes(plainly_patched(pinned_upstream, tmp_path, 'expected'), pin)
    apply_ok(clone, '--revert')
    assert fingerprint(clone) == before


# -- installed files and git status --------------------------------------------------------------

def test_installed_files_are_kept_out_of_git_status_and_the_entries_go_on_revert(pin, clone):
    exclude = clone / '.git' / 'info' / 'exclude'
    original = exclude.read_bytes()  # git init writes one, with comments only
    apply_ok(clone)
    status = git(clone, 'status', '--porcelain', '--untracked-files=all').splitlines()
    assert sorted(status) == sorted(f' M {path}' for path in pin.touched), status
    for installed in ('ddp_train_dual.py', 'yolov9_ddp/__init__.py', STATE):
        assert (clone / installed).is_file()
        assert git(clone, 'check-ignore', '--verbose', installed).startswith('.git/info/exclude:'), installed
    assert git(clone, 'ls-files') == git(clone, 'ls-tree', '-r', '--name-only', 'HEAD')  # nothing tracked added
    apply_ok(clone, '--revert')
    assert exclude.read_bytes() == original
    assert git(clone, 'status', '--porcelain', '--untracked-files=all') == ''


# -- another upstream revision -------------------------------------------------------------------

def move_upstream(repo: Path, change: str):
    """Upstream commits a change to utils/metrics.py: far from every hunk, on a line patch 0006 changes, or on a
    context line of its hunk (only reduced context accepts it)."""
    metrics = repo / 'utils' / 'metrics.py'
    if change == 'far':
        metrics.write_text('# upstream added a header line\n# and another one\n' + metrics.read_text())
    elif change == 'conflict':
        edit(metrics, METRICS_INTEGRATE, METRICS_INTEGRATE.replace('# integrate', '# area under the curve'))
    else:
        edit(metrics, METRICS_CONTEXT, "    method = 'interp'  # methods: 'interp' or 'continuous'\n")
    if (repo / '.git').exists():
        commit_upstream(repo, f'upstream changes utils/metrics.py ({change})')


@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
@pytest.mark.parametrize('history', ['clone', 'copy'], ids=['git-clone', 'copy-without-git'])
def test_another_revision_is_applied_only_with_the_flag_and_recorded(pin, pristine_tree, tmp_path, offline_env,
                                                                    history):
    if history == 'clone':
        make_git_repo(pristine_tree)
    move_upstream(pristine_tree, 'far')
    expected = plainly_patched(pristine_tree, tmp_path, 'expected')  # git apply finds the moved hunks
    before = snapshot(pristine_tree, modes=True)
    moved = f'{sum("utils/metrics.py" in patch_files(name) for name in SERIES)} offset'  # each patch of the file

    check = run_applier(pristine_tree, '--check')
    assert check.returncode == 3 and f'every patch still applies ({moved})' in check.stdout, describe(check)
    assert 'add --allow-other-revision to apply the series anyway' in check.stdout
    error, hint = refused(pristine_tree)
    assert 'utils/metrics.py differs from the pin' in error
    assert 'add --allow-other-revision to apply the series anyway' in hint and f'({moved})' in hint
    check = run_applier(pristine_tree, '--check', '--allow-other-revision')
    assert check.returncode == 0 and f'would apply to another upstream revision ({moved}' in check.stdout

    result = apply_ok(pristine_tree, '--allow-other-revision')
    assert f'applied to another upstream revision ({moved}; recorded)' in result.stdout, describe(result)
    assert touched_bytes(pristine_tree, pin) == touched_bytes(expected, pin)
    assert json.loads((pristine_tree / STATE).read_text())['other_revision'] is True
    assert 'to another upstream revision' in apply_ok(pristine_tree, '--status').stdout.splitlines()[0]
    assert 'nothing to do' in apply_ok(pristine_tree).stdout  # the record carries the consent
    assert_works(pristine_tree, offline_env)
    apply_ok(pristine_tree, '--revert')
    assert snapshot(pristine_tree, modes=True) == before


@pytest.mark.parametrize('change, status', [('conflict', 'conflict'), ('fuzz', 'fuzz')])
def test_the_flag_never_applies_a_conflict_or_fuzz(clone, change, status):
    move_upstream(clone, change)
    patch = next(name for name in SERIES if name.startswith('0006'))
    error, hint = refused(clone, '--allow-other-revision')
    assert 'utils/metrics.py differs from the pin' in error and f'{patch} ({status})' in hint, hint
    check = run_applier(clone, '--check', '--allow-other-revision')
    assert check.returncode == 1 and f'{patch} ({status})' in check.stdout, describe(check)


# -- kit upgrades --------------------------------------------------------------------------------

def other_kit(tmp_path: Path, version: str) -> Path:
    """A copy of this kit as another version of it would be: its version, one line of one patch changed (an added
    comment), and its installed package different."""
    kit = copy_kit(tmp_path / f'kit-{version}')
    init = kit / 'yolov9_ddp' / '__init__.py'
    init.write_text(re.sub(r"(?m)^__version__ = .*$", f"__version__ = '{version}'", init.read_text()))
    patch = kit / 'patches' / next(name for name in SERIES if name.startswith('0006'))
    text = patch.read_text()
    added = re.search(r'(?m)^\+.*#.*$', text).group(0)
    patch.write_text(text.replace(added, f'{added} (kit {version})', 1))
    return kit


def test_a_tree_of_an_older_kit_is_upgraded_in_one_step_with_the_users_edits(pin, clone, tmp_path):
    common = clone / 'models' / 'common.py'
    edit(common, ANCHOR, CUSTOM_BLOCK + ANCHOR)
    edited = fingerprint(clone)
    fresh = copy_tree(clone, tmp_path / 'fresh')  # the same clone, patched by this kit only
    shutil.copytree(clone / '.git', fresh / '.git')
    apply_ok(fresh)

    old = other_kit(tmp_path, '0.1.9')
    apply_ok(clone, kit=old)
    assert 'outdated' in apply_ok(clone, '--status').stdout.splitlines()[0]
    check = apply_ok(clone, '--check')
    assert 'would upgrade: the series of kit 0.1.9 taken out' in check.stdout, describe(check)
    result = apply_ok(clone)
    assert 'upgraded: the series of kit 0.1.9 taken out' in result.stdout, describe(result)
    assert snapshot(clone, modes=True) == snapshot(fresh, modes=True)  # files, installed kit, record
    apply_ok(clone, '--revert')
    assert fingerprint(clone) == edited


def test_any_later_kit_reverts_a_tree_this_kit_patched(clone, tmp_path):
    before = fingerprint(clone)
    apply_ok(clone)
    later = other_kit(tmp_path, '9.0.0')
    assert 'applied by kit' in apply_ok(clone, '--status', kit=later).stdout.splitlines()[0]
    apply_ok(clone, '--revert', kit=later)
    assert fingerprint(clone) == before


@pytest.mark.parametrize('operation', ['apply', '--revert'])
def test_a_tree_patched_by_kit_0_1_0_is_upgraded_or_reverted(pin, pinned_upstream, pristine_tree, tmp_path,
                                                             operation):
    # What kit 0.1.0 left: its series applied, its files installed, a record of patch names and installed blobs.
    git(pristine_tree, 'apply', str(PATCHES / 'previous' / 'kit-0.1.0.diff'))
    found = {path: git(pristine_tree, 'hash-object', path).strip() for path in pin.touched}
    assert {path: found[path] for path in KIT_0_1_0_FILES} == KIT_0_1_0_FILES  # the files its series patched
    assert all(found[path] == pin.touched[path] for path in set(found) - set(KIT_0_1_0_FILES))  # the rest: pinned
    installed = {}
    for relative in ('ddp_train_dual.py', 'yolov9_ddp/__init__.py', 'yolov9_ddp/comm.py'):
        data = (KIT / relative).read_bytes() + b'# as kit 0.1.0 had it\n'
        (pristine_tree / relative).parent.mkdir(exist_ok=True)
        (pristine_tree / relative).write_bytes(data)
        installed[relative] = git(pristine_tree, 'hash-object', relative).strip()
    (pristine_tree / STATE).write_text(json.dumps({'kit': 'yolov9-ddp', 'upstream': pin.commit, 'patches': SERIES,
                                                   'installed': installed}, indent=1, sort_keys=True) + '\n')
    assert 'applied by kit 0.1.0' in apply_ok(pristine_tree, '--status').stdout.splitlines()[0]

    if operation == '--revert':
        apply_ok(pristine_tree, '--revert')
        assert snapshot(pristine_tree, modes=True) == snapshot(pinned_upstream, modes=True)
        return
    result = apply_ok(pristine_tree)
    assert 'upgraded: the series of kit 0.1.0 taken out' in result.stdout, describe(result)
    fresh = copy_tree(pinned_upstream, tmp_path / 'fresh')
    apply_ok(fresh)
    assert snapshot(pristine_tree, modes=True) == snapshot(fresh, modes=True)


# -- git's language, and no POSIX-only import ----------------------------------------------------

def test_git_is_read_in_english_whatever_the_users_locale(clone, tmp_path):
    move_upstream(clone, 'far')  # patch 0006 applies with an offset: git says so in a sentence it translates
    patch = next(name for name in SERIES if name.startswith('0006'))
    german = {'LANGUAGE': 'de', 'LC_ALL': 'C.UTF-8', 'LANG': 'de_DE.UTF-8'}
    real_git = shutil.which('git')
    translated = subprocess.run([real_git, 'apply', '--check', '-v', str(PATCHES / patch)], cwd=str(clone),
                                capture_output=True, text=True, env=clean_env(**german)).stderr
    if Path('/usr/share/locale/de/LC_MESSAGES/git.mo').is_file():  # this git speaks German: the case is real
        assert '#1' in translated and 'succeeded' not in translated, translated
    # every git the applier starts is logged with its locale variables
    wrapper, log = tmp_path / 'bin' / 'git', tmp_path / 'git-env.log'
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "LC_ALL=${{LC_ALL-unset}} LANGUAGE=${{LANGUAGE-unset}}" >> {log}\n'
                       f'exec {real_git} "$@"\n')
    wrapper.chmod(0o755)
    env = clean_env(PATH=f'{wrapper.parent}{os.pathsep}{os.environ["PATH"]}', **german)
    result = run_applier(clone, '--check', '--json', env=env)
    assert result.returncode == 3, describe(result)
    entry = next(e for e in json.loads(result.stdout)['drift'] if e['name'] == patch)
    assert entry['status'] == 'offset' and entry['offsets'][0]['offset'] == 2
    calls = log.read_text().splitlines()
    assert calls and set(calls) == {'LC_ALL=C LANGUAGE=unset'}


def test_the_applier_imports_and_checks_without_posix_only_modules(pristine_tree):
    # As on Windows: fcntl, pwd, grp, termios and resource do not exist there.
    code = ('import sys\n'
            'for name in ("fcntl", "pwd", "grp", "termios", "resource"): sys.modules[name] = None\n'
            f'sys.path.insert(0, {str(KIT)!r})\n'
            'import apply_patches\n'
            f'sys.exit(apply_patches.main([{str(pristine_tree)!r}, "--check"]))\n')
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=clean_env(),
                            timeout=300)
    assert result.returncode == 0 and 'would apply' in result.stdout, describe(result)


def test_a_journal_left_by_a_killed_kit_0_1_0_run_is_restored(pinned_upstream, pristine_tree):
    # Kit 0.1.0 journaled {path: mode, or None for a file it created} with the copies under files/PATH.
    journal = pristine_tree / '.yolov9-ddp-journal'
    (journal / 'files' / 'utils').mkdir(parents=True)
    shutil.copy2(pristine_tree / 'utils' / 'general.py', journal / 'files' / 'utils' / 'general.py')
    (journal / 'manifest.json').write_text(json.dumps({'utils/general.py': 0o644, 'ddp_train_dual.py': None}))
    (pristine_tree / 'utils' / 'general.py').write_text('half written by the killed run\n')
    (pristine_tree / 'ddp_train_dual.py').write_text('half installed\n')

    result = apply_ok(pristine_tree)
    assert 'an earlier run was interrupted; restored 2 files from its journal' in result.stdout, describe(result)
    apply_ok(pristine_tree, '--revert')
    assert snapshot(pristine_tree, modes=True) == snapshot(pinned_upstream, modes=True)
