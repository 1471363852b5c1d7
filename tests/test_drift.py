"""The drift report against upstream revisions that are not the pin, the CI workflow that runs it, and the
maintainers' refresh path of docs/applier.md ("When upstream moves").

Each scenario makes a git repository of the pinned tree and commits a change that simulates upstream moving:
lines inserted above a hunk, a context line changed, a fix merged upstream, a touched file deleted or renamed.
`apply_patches.py --check --json` then runs the way CI runs it. Every check also proves that the replay left
the target alone (files, HEAD and git status), and apply_patches.py must refuse to apply on every such tree.
"""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from patchkit.pin import file_blob_id
from testsupport.trees import (KIT, PATCHES, SERIES, clean_env, commit_upstream, copy_kit, copy_tree, describe, git,
                               make_git_repo, run_applier, snapshot)

WORKFLOW = KIT / '.github' / 'workflows' / 'upstream-regression.yml'
APPLIER_DOC = KIT / 'docs' / 'applier.md'
# The lines the scenarios move, as the pinned files have them (each occurs once in its file).
METRICS_CONTEXT = "    method = 'interp'  # methods: 'continuous', 'interp'\n"  # first context line of 0006's hunk
METRICS_CHANGED = 'ap = np.trapz(np.interp(x, mrec, mpre), x)  # integrate\n'  # the line 0006 changes
PLOTS_CONTEXT = "        if anchor == 'bottom':  # start y from font bottom\n"  # right above 0004's change in hunk 2


# -- helpers -------------------------------------------------------------------------------------

def patch_named(prefix: str) -> str:
    return next(name for name in SERIES if name.startswith(prefix))


def insert_at_top(path: Path, count: int):
    path.write_text(''.join(f'# upstream added line {i}\n' for i in range(count)) + path.read_text())


def replace_once(path: Path, old: str, new: str):
    text = path.read_text()
    assert text.count(old) == 1, f'{old!r} is not once in {path}'
    path.write_text(text.replace(old, new))


def merge_upstream(repo: Path, prefix: str):
    """Upstream merges exactly the change of one patch of the series (applied with plain git, not the kit)."""
    git(repo, 'apply', str(PATCHES / patch_named(prefix)))


def git_accepts(tree: Path, patch: str, *flags) -> bool:
    return subprocess.run(['git', 'apply', '--check', *flags, str(PATCHES / patch)], cwd=str(tree),
                          env=clean_env(), capture_output=True).returncode == 0


def fingerprint(tree: Path):
    """Everything the drift replay must leave alone: the files and, in a repository, HEAD and git status."""
    if not (tree / '.git').exists():
        return snapshot(tree, modes=True)
    return snapshot(tree, modes=True), git(tree, 'rev-parse', 'HEAD'), git(tree, 'status', '--porcelain')


def check(tree: Path, *output):
    """Run `apply_patches.py TREE --check` with the given output flags; the target must come out unchanged."""
    before = fingerprint(tree)
    result = run_applier(tree, '--check', *output)
    assert fingerprint(tree) == before, f'--check changed the target\n{describe(result)}'
    assert 'Traceback' not in result.stderr, describe(result)
    return result


def check_json(tree: Path):
    """(exit status, report) of --check --json."""
    result = check(tree, '--json')
    report = json.loads(result.stdout)
    assert report['exit'] == result.returncode and report['ok'] is (result.returncode == 0), describe(result)
    return result.returncode, report


def drift_of(report) -> dict:
    """{patch name: its drift entry}, in series order."""
    assert [entry['name'] for entry in report['drift']] == SERIES
    return {entry['name']: entry for entry in report['drift']}


def assert_others_clean(drift: dict, *moved_prefixes):
    others = {name: entry['status'] for name, entry in drift.items() if not name.startswith(moved_prefixes)}
    assert others == {name: 'clean' for name in others}


def assert_apply_refused(tree: Path, *facts):
    """apply_patches.py refuses: exit 1, a one-line cause (plus its hint line), the tree exactly as it was."""
    before = fingerprint(tree)
    result = run_applier(tree)
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and lines and lines[0].startswith('apply_patches.py: error: '), describe(result)
    assert all(line.startswith('apply_patches.py: hint: ') for line in lines[1:]) and len(lines) <= 2, \
        describe(result)
    for fact in facts:
        assert fact in lines[0], f'{fact!r} is not in {lines[0]!r}'
    assert fingerprint(tree) == before, 'the refused apply changed the tree'


def changed_files(report) -> dict:
    return {f['path']: (f['expected'], f['found']) for f in report['files'] if not f['matches']}


@pytest.fixture
def upstream_repo(pristine_tree) -> Path:
    """A git repository holding the pinned tree as its only commit: the upstream clone the tests move."""
    make_git_repo(pristine_tree)
    return pristine_tree


# -- (a) lines inserted above a hunk -------------------------------------------------------------

def test_lines_inserted_above_a_hunk_give_offset_and_exit_3(pin, upstream_repo):
    metrics = upstream_repo / 'utils' / 'metrics.py'
    insert_at_top(metrics, 2)
    commit_upstream(upstream_repo, 'upstream adds two lines at the top of utils/metrics.py')

    code, report = check_json(upstream_repo)
    assert code == 3 and report['state'] == 'modified'
    drift = drift_of(report)
    moved = drift[patch_named('0006')]
    assert moved['status'] == 'offset' and moved['passes'] is True
    assert [(o['file'], o['hunk'], o['offset']) for o in moved['offsets']] == [('utils/metrics.py', 1, 2)]
    also_moved = drift[patch_named('0009')]  # distributed validation adds its helper to utils/metrics.py too
    assert also_moved['status'] == 'offset' and all(o['offset'] == 2 for o in also_moved['offsets'])
    assert_others_clean(drift, '0006', '0009')
    assert all(entry['passes'] for entry in drift.values())
    assert changed_files(report) == {'utils/metrics.py': (pin.touched['utils/metrics.py'], file_blob_id(metrics))}

    text = check(upstream_repo)
    assert text.returncode == 3 and 'every patch still applies' in text.stdout and 'ok (offset)' in text.stdout
    assert_apply_refused(upstream_repo, 'utils/metrics.py', 'differs from the pin')


# -- (b) a context line changed ------------------------------------------------------------------

def test_a_changed_context_line_is_a_conflict_naming_file_hunk_and_line(upstream_repo, tmp_path):
    plots = upstream_repo / 'utils' / 'plots.py'
    edited = "        if anchor == 'bottom':  # y starts at the bottom of the font\n"
    insert_at_top(plots, 3)  # lines above as well: the report must still find the hunk's place
    replace_once(plots, PLOTS_CONTEXT, edited)
    commit_upstream(upstream_repo, 'upstream rewords a comment in Annotator.text')
    # Where the line sits in the file as the patches before 0004 leave it, worked out with plain git.
    expected_file = copy_tree(upstream_repo, tmp_path / 'before-0004')
    for name in SERIES[:SERIES.index(patch_named('0004'))]:
        git(expected_file, 'apply', str(PATCHES / name))
    expected_line = (expected_file / 'utils' / 'plots.py').read_text().splitlines().index(edited.rstrip('\n')) + 1

    code, report = check_json(upstream_repo)
    assert code == 1
    drift = drift_of(report)
    conflict = drift[patch_named('0004')]
    assert conflict['status'] == 'conflict' and conflict['passes'] is False
    assert (conflict['file'], conflict['hunk']) == ('utils/plots.py', 2)
    assert conflict['mismatch_line'] == expected_line
    assert conflict['expected_text'] == PLOTS_CONTEXT.rstrip('\n') and conflict['found_text'] == edited.rstrip('\n')
    for moved in ('0003', '0015'):  # they touch utils/plots.py too
        assert drift[patch_named(moved)]['status'] == 'offset', moved
    assert_others_clean(drift, '0003', '0004', '0015')  # the patches after the conflict were still checked

    text = check(upstream_repo)
    assert text.returncode == 1 and 'does not apply' in text.stdout, describe(text)
    row = next(line for line in text.stdout.splitlines() if line.lstrip().startswith(patch_named('0004')))
    assert 'CONFLICT' in row and f'utils/plots.py hunk 2, line {expected_line}' in row and 'y starts at' in row
    assert_apply_refused(upstream_repo, 'utils/plots.py', 'differs from the pin')


# -- (c) a fix merged upstream -------------------------------------------------------------------

@pytest.mark.parametrize('merged', ['0001', '0006'], ids=['first-patch', 'middle-patch'])
def test_a_fix_merged_upstream_is_reported_and_skipped(upstream_repo, merged):
    # Upstream's only change is the fix. Merged from the first patch, it leaves the touched files equal to
    # "pin + 0001": what a half-applied series looks like. In a clean git clone the commit is upstream's,
    # so it must get the drift report.
    merge_upstream(upstream_repo, merged)
    commit_upstream(upstream_repo, f'upstream merges the fix of patch {merged}')

    code, report = check_json(upstream_repo)
    assert code == 3 and report['state'] == 'modified'
    drift = drift_of(report)
    contained = drift[patch_named(merged)]
    assert contained['status'] == 'upstream' and contained['passes'] is True and 'dropped' in contained['detail']
    assert_others_clean(drift, merged)  # the patches after it were replayed: each applied as written

    assert_apply_refused(upstream_repo, 'differs from the pin')
    before = fingerprint(upstream_repo)
    result = run_applier(upstream_repo, '--revert')  # must not "revert" upstream's own fix
    assert result.returncode == 1 and 'differs from the pin' in result.stderr, describe(result)
    assert fingerprint(upstream_repo) == before


def test_a_prefix_of_the_series_outside_git_history_names_both_readings(pristine_tree, pinned_upstream, tmp_path):
    git(pristine_tree, 'apply', str(PATCHES / SERIES[0]))  # a plain folder: no history to ask
    on_pinned_head = copy_tree(pinned_upstream, tmp_path / 'clone')
    make_git_repo(on_pinned_head)
    git(on_pinned_head, 'apply', str(PATCHES / SERIES[0]))  # uncommitted, on top of the pin: half-applied

    code, report = check_json(pristine_tree)
    assert code == 1 and report['state'] == 'partial'
    assert 'half-applied' in report['action'] and 'another upstream revision' in report['action']
    assert drift_of(report)[SERIES[0]]['status'] == 'upstream'
    assert_others_clean(drift_of(report), SERIES[0][:4])

    code, report = check_json(on_pinned_head)
    assert code == 1 and report['state'] == 'partial'
    assert 'half-applied' in report['action'] and 'another upstream revision' not in report['action']
    assert_apply_refused(pristine_tree, 'half-applied', SERIES[0])


# -- (d) a touched file deleted or renamed -------------------------------------------------------

@pytest.mark.parametrize('move, path, prefixes, shifted', [
    # 0009 adds lines to val_triple.py above 0011's hunk; without 0009 that hunk sits higher
    ('rm', 'utils/metrics.py', ('0006', '0009'), ('0011',)),
    # 0003 also adds a line to utils/general.py; without it, 0005's hunk there sits one line higher
    ('mv', 'utils/plots.py', ('0003', '0004', '0015'), ('0005',)),
], ids=['deleted', 'renamed'])
def test_a_deleted_or_renamed_touched_file_is_missing(upstream_repo, move, path, prefixes, shifted):
    git(upstream_repo, *(['rm', '--quiet', path] if move == 'rm' else ['mv', path, path.replace('.py', '_v2.py')]))
    commit_upstream(upstream_repo, f'upstream {"deletes" if move == "rm" else "renames"} {path}')

    code, report = check_json(upstream_repo)
    assert code == 1
    drift = drift_of(report)
    for prefix in prefixes:
        entry = drift[patch_named(prefix)]
        assert (entry['status'], entry['file'], entry['passes']) == ('missing', path, False)
    assert [drift[patch_named(prefix)]['status'] for prefix in shifted] == ['offset'] * len(shifted)
    assert_others_clean(drift, *prefixes, *shifted)
    assert changed_files(report)[path][1] is None
    assert_apply_refused(upstream_repo, path, 'is missing')


# -- fuzz ----------------------------------------------------------------------------------------

def test_a_change_only_reduced_context_accepts_is_fuzz_and_fails(upstream_repo):
    metrics = upstream_repo / 'utils' / 'metrics.py'
    replace_once(metrics, METRICS_CONTEXT, "    method = 'interp'  # methods: 'interp' or 'continuous'\n")
    commit_upstream(upstream_repo, 'upstream rewords a comment three lines above the np.trapz call')
    fuzzy = patch_named('0006')
    assert not git_accepts(upstream_repo, fuzzy) and git_accepts(upstream_repo, fuzzy, '-C1'), \
        'the scenario is not a fuzz case: git apply must need -C1 for it'

    code, report = check_json(upstream_repo)
    assert code == 1
    drift = drift_of(report)
    assert drift[fuzzy]['status'] == 'fuzz' and drift[fuzzy]['passes'] is False
    assert 'reduced context' in drift[fuzzy]['detail'] and 'utils/metrics.py' in drift[fuzzy]['detail']
    assert_others_clean(drift, '0006')
    assert_apply_refused(upstream_repo, 'utils/metrics.py', 'differs from the pin')


# -- the Markdown rendering ----------------------------------------------------------------------

def markdown_rows(text: str, header: str) -> list:
    """The cells of each row of the Markdown table that starts with the header line."""
    lines = text.splitlines()
    start = lines.index(header)
    assert re.fullmatch(r'(\|---)+\|', lines[start + 1]), lines[start + 1]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith('|'):
            break
        rows.append([cell.strip() for cell in re.split(r'(?<!\\)\|', line)[1:-1]])
    return rows


def test_markdown_report_has_the_patch_table_the_blob_changes_and_a_verdict(pin, upstream_repo):
    merge_upstream(upstream_repo, '0001')  # touches utils/loggers/__init__.py: underscores must stay literal
    replace_once(upstream_repo / 'utils' / 'metrics.py', METRICS_CHANGED, METRICS_CHANGED.replace('integrate', 'area'))
    insert_at_top(upstream_repo / 'utils' / 'dataloaders.py', 2)
    commit_upstream(upstream_repo, 'upstream merges 0001, edits the np.trapz line, adds lines to dataloaders.py')

    result = check(upstream_repo, '--markdown')
    assert result.returncode == 1, describe(result)
    rows = markdown_rows(result.stdout, '| patch | status | detail |')
    statuses = {name: status for name, status, _ in rows}
    assert [name for name, _, _ in rows] == SERIES
    assert statuses[SERIES[0]] == 'already upstream'
    assert statuses[patch_named('0006')] == 'CONFLICT' and statuses[patch_named('0010')] == 'ok (offset)'
    assert {s for name, s in statuses.items() if not name.startswith(('0001', '0006', '0010'))} == {'ok'}
    conflict_detail = next(detail for name, _, detail in rows if name.startswith('0006'))
    assert 'utils/metrics.py hunk 1' in conflict_detail and '# area' in conflict_detail

    blobs = markdown_rows(result.stdout, '| file | pinned blob | found |')
    expected = {path: [pin.touched[path], file_blob_id(upstream_repo / path)] for path in
                ('utils/dataloaders.py', 'utils/general.py', 'utils/loggers/__init__.py', 'utils/metrics.py')}
    assert {path.replace('\\_', '_'): ids for path, *ids in blobs} == expected
    assert r'utils/loggers/\_\_init\_\_.py' in result.stdout

    verdict = result.stdout.rstrip('\n').splitlines()[-1]
    assert verdict.startswith('**Verdict: fail (exit 1)**') and patch_named('0006') in verdict.replace('\\', '')


def test_markdown_verdicts_follow_the_exit_status(upstream_repo, tmp_path):
    result = check(upstream_repo, '--markdown')
    assert result.returncode == 0 and result.stdout.rstrip().splitlines()[-1].startswith('**Verdict: pass (exit 0)**')
    assert '| file | pinned blob | found |' not in result.stdout

    insert_at_top(upstream_repo / 'utils' / 'metrics.py', 1)
    commit_upstream(upstream_repo, 'upstream adds a line')
    result = check(upstream_repo, '--markdown')
    assert result.returncode == 3
    assert result.stdout.rstrip().splitlines()[-1].startswith('**Verdict: upstream moved, every patch still applies')

    missing = tmp_path / 'no-such-tree'
    result = run_applier(missing, '--check', '--markdown')
    assert result.returncode == 1 and 'does not exist' in result.stdout.splitlines()[-1], describe(result)
    assert result.stdout.splitlines()[-1].startswith('**Verdict: fail (exit 1)**')
    assert run_applier(upstream_repo, '--status', '--markdown').returncode == 2  # only --check has a verdict


# -- the CI workflow -----------------------------------------------------------------------------

def workflow_steps() -> dict:
    """{step id or name: step} of the workflow's only job."""
    jobs = yaml.safe_load(WORKFLOW.read_text())['jobs']
    assert len(jobs) == 1
    return {step.get('id') or step.get('name') or step['uses']: step for step in next(iter(jobs.values()))['steps']}


def test_workflow_runs_weekly_and_on_demand_kit_files_only_and_never_names_the_pin(pin):
    text = WORKFLOW.read_text()
    workflow = yaml.safe_load(text)
    triggers = workflow.get('on', workflow.get(True))  # YAML 1.1 reads the bare key `on` as true
    assert re.fullmatch(r'\S+ \S+ \S+ \S+ \S+', triggers['schedule'][0]['cron'])
    assert 'workflow_dispatch' in triggers

    steps = workflow_steps()
    scripts = '\n'.join(step['run'] for step in steps.values() if 'run' in step)
    files = re.findall(r'(?<![\w-])python3?\s+(?!-)(\S+)', scripts)
    assert {'apply_patches.py', 'fetch_upstream.py'} <= set(files)
    assert [f for f in files if not (KIT / f).is_file()] == []
    assert '--check --json' in scripts and '--check --markdown' in scripts and 'GITHUB_STEP_SUMMARY' in scripts
    assert 'python -m pytest -q -n 2 --dist loadfile tests' in scripts and 'YOLOV9_UPSTREAM' in str(steps)
    assert any(step.get('with', {}).get('python-version') == '3.11' for step in steps.values())
    assert any(step.get('uses', '').startswith('actions/upload-artifact') for step in steps.values())
    assert 'patches/UPSTREAM' in text or 'read_pin' in text
    assert pin.commit not in text and not re.search(rf'\b{pin.short}', text)
    for name, step in steps.items():  # every script parses
        if 'run' in step:
            parsed = subprocess.run(['bash', '-n'], input=step['run'], text=True, capture_output=True)
            assert parsed.returncode == 0, f'step {name}: {parsed.stderr}'


def test_workflow_actions_are_pinned_to_commits_and_checkout_keeps_no_token():
    """A workflow linter's findings: a tag can be moved to other code, and checkout's token stays in .git/config."""
    uses = re.findall(r'(?m)^\s*(?:- )?uses:\s*(\S+)(.*)$', WORKFLOW.read_text())
    assert len(uses) == 3
    for action, comment in uses:
        assert re.fullmatch(r'[\w-]+/[\w-]+@[0-9a-f]{40}', action), f'{action} is not pinned to a commit'
        assert re.fullmatch(r'\s*# v\d+\.\d+\.\d+', comment), f'{action}: no version comment'
    checkout = next(step for step in workflow_steps().values() if step.get('uses', '').startswith('actions/checkout'))
    assert checkout['with']['persist-credentials'] is False


def run_step(step: dict, temp: Path, **env) -> subprocess.CompletedProcess:
    """Run one `run:` step the way GitHub's `shell: bash` does, in the kit, with `python` being this Python."""
    bin_dir = temp / 'bin'
    bin_dir.mkdir(exist_ok=True)
    python = bin_dir / 'python'  # a script, not a link: a link to a venv's python would lose the venv
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    files = {name: temp / name.lower() for name in ('GITHUB_ENV', 'GITHUB_OUTPUT', 'GITHUB_STEP_SUMMARY')}
    for path in files.values():
        path.touch()
    environment = clean_env(PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', RUNNER_TEMP=str(temp),
                            **{k: str(v) for k, v in files.items()}, **env)
    return subprocess.run(['bash', '--noprofile', '--norc', '-eo', 'pipefail', '-c', step['run']], cwd=str(KIT),
                          env=environment, capture_output=True, text=True, timeout=300)


def step_outputs(temp: Path) -> dict:
    return dict(line.split('=', 1) for line in (temp / 'github_output').read_text().splitlines())


@pytest.mark.parametrize('latest, latest_exit, verdict_exit, annotation', [
    ('offset', '3', 0, '::warning::'),
    ('conflict', '1', 1, '::error::'),
])
def test_workflow_reports_both_trees_and_fails_only_when_a_patch_stops_applying(
        pin, pinned_upstream, tmp_path, latest, latest_exit, verdict_exit, annotation):
    temp = tmp_path / 'runner'
    temp.mkdir()
    steps = workflow_steps()
    result = run_step(steps['pin'], temp)
    assert result.returncode == 0, describe(result)
    assert (temp / 'github_env').read_text().splitlines() == [f'UPSTREAM_REPOSITORY={pin.repository}',
                                                              f'UPSTREAM_COMMIT={pin.commit}']
    # What the clone step leaves behind: the pin, and upstream's default branch (here moved by one commit).
    make_git_repo(copy_tree(pinned_upstream, temp / 'upstream-pinned'))
    moved = copy_tree(pinned_upstream, temp / 'upstream-latest')
    make_git_repo(moved)
    metrics = moved / 'utils' / 'metrics.py'
    if latest == 'offset':
        insert_at_top(metrics, 2)
    else:
        replace_once(metrics, METRICS_CHANGED, METRICS_CHANGED.replace('integrate', 'area'))
    commit_upstream(moved, 'upstream moves')

    result = run_step(steps['drift'], temp)
    assert result.returncode == 0, describe(result)
    outputs = step_outputs(temp)
    assert outputs == {'pinned': '0', 'latest': latest_exit}
    reports = {name: json.loads((temp / 'drift-reports' / f'{name}.json').read_text()) for name in outputs}
    assert reports['pinned']['state'] == 'pristine' and str(reports['latest']['exit']) == latest_exit
    summary = (temp / 'github_step_summary').read_text()
    for name in outputs:
        assert f'## {name} upstream: {git(temp / f"upstream-{name}", "rev-parse", "HEAD").strip()}' in summary
    assert summary.count('| patch | status | detail |') == 2
    assert '**Verdict: pass (exit 0)**' in summary and f'(exit {latest_exit})**' in summary

    result = run_step(steps['verdict'], temp, PINNED_EXIT=outputs['pinned'], LATEST_EXIT=outputs['latest'])
    assert result.returncode == verdict_exit and annotation in result.stdout, describe(result)
    result = run_step(steps['verdict'], temp, PINNED_EXIT='1', LATEST_EXIT='0')  # the pin itself broke
    assert result.returncode == 1 and '::error::' in result.stdout, describe(result)


# -- the refresh path of docs/applier.md ---------------------------------------------------------

def test_the_documented_refresh_path_carries_the_series_onto_a_new_upstream(pinned_upstream, tmp_path):
    section = APPLIER_DOC.read_text().split('## When upstream moves', 1)[1].split('\n## ', 1)[0]
    for command in ('apply_patches.py --commits', 'rebase', 'sed -i "s/^commit .*/commit $new/" patches/UPSTREAM',
                    'apply_patches.py --refresh', 'YOLOV9_UPSTREAM="$clone" ./run-tests.sh'):
        assert command in section, f'docs/applier.md no longer says {command!r}'
    # A copy of the kit, since --refresh writes patches/. The real pin cannot be recreated offline: the
    # clone's root commit holds the pinned tree and stands in for it in the copy's patches/UPSTREAM.
    kit = copy_kit(tmp_path / 'kit')
    clone = copy_tree(pinned_upstream, tmp_path / 'clone')
    base = make_git_repo(clone)
    upstream_file = kit / 'patches' / 'UPSTREAM'
    upstream_file.write_text(re.sub(r'(?m)^commit \S+$', f'commit {base}', upstream_file.read_text()))
    # Upstream moves: it merges patch 0001, rewrites the line patch 0006 changes, adds lines above 0010's hunks.
    merge_upstream(clone, '0001')
    replace_once(clone / 'utils' / 'metrics.py', METRICS_CHANGED, METRICS_CHANGED.replace('integrate', 'area'))
    insert_at_top(clone / 'utils' / 'dataloaders.py', 2)
    commit_upstream(clone, 'upstream moves')
    new = git(clone, 'rev-parse', 'HEAD').strip()

    git(clone, 'switch', '--quiet', '-c', 'refresh', base)  # 1. a branch at the pin
    result = run_applier(None, '--commits', str(clone), kit=kit)  # 2. one commit per patch
    assert result.returncode == 0, describe(result)
    with pytest.raises(AssertionError, match='could not apply'):  # 3. patch 0006 conflicts
        git(clone, 'rebase', new)
    assert git(clone, 'status', '--porcelain', '--untracked-files=no') == 'UU utils/metrics.py\n'
    resolved = METRICS_CHANGED.replace('integrate', 'area').replace('np.trapz', 'np.trapezoid')
    metrics = clone / 'utils' / 'metrics.py'
    metrics.write_text(git(clone, 'show', f'{new}:utils/metrics.py').replace(METRICS_CHANGED.replace(
        'integrate', 'area'), resolved))
    git(clone, 'add', 'utils/metrics.py')
    git(clone, '-c', 'core.editor=true', 'rebase', '--continue')
    upstream_file.write_text(re.sub(r'(?m)^commit \S+$', f'commit {new}', upstream_file.read_text()))  # 4.
    result = run_applier(None, '--refresh', str(clone), kit=kit)  # 5.
    assert result.returncode == 0, describe(result)

    # The series lost the patch upstream merged, kept the others in order, and pins the new commit's blobs.
    series = (kit / 'patches' / 'series').read_text().split()
    assert [name[5:] for name in series] == [name[5:] for name in SERIES[1:]]
    assert series == [f'{n:04d}-{name[5:]}' for n, name in enumerate(SERIES[1:], 1)]
    assert sorted(p.name for p in (kit / 'patches').glob('*.patch')) == series
    pin_text = upstream_file.read_text()
    assert f'commit {new}\n' in pin_text
    touched = dict(reversed(line.split()) for line in
                   pin_text.split('[touched]\n', 1)[1].split('\n\n', 1)[0].splitlines())
    changed = {path for name in series
               for path in re.findall(r'(?m)^diff --git a/(\S+) ', (kit / 'patches' / name).read_text())}
    assert set(touched) == changed  # exactly the files the refreshed patches change
    assert touched == {path: git(clone, 'rev-parse', f'{new}:{path}').strip() for path in touched}

    # 6. the refreshed series applies cleanly to a fresh checkout of the new upstream, with the resolution in.
    fresh = tmp_path / 'fresh'
    git(tmp_path, 'clone', '--quiet', str(clone), str(fresh))
    git(fresh, 'checkout', '--quiet', '--detach', new)
    result = run_applier(fresh, '--check', kit=kit)
    assert result.returncode == 0 and 'would apply' in result.stdout, describe(result)
    result = run_applier(fresh, kit=kit)
    assert result.returncode == 0, describe(result)
    assert resolved in (fresh / 'utils' / 'metrics.py').read_text()
