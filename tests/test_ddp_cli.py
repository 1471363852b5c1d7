"""The command line of ddp_train_dual.py and what a launch looks like from outside, each shown by a real run
(torchrun or the legacy torch.distributed.launch, gloo on CPU):

  - every flag of upstream's train_dual.py, with the same meaning (parser objects compared action by action)
  - --help documents the kit's own flags
  - the legacy launcher (which passes --local-rank) works
  - without --data the run trains on the generated demo dataset
  - rank 0 shows progress and logs; other ranks print only warnings and errors, prefixed with their rank
  - one run folder per run, created by rank 0 only, incremented as upstream
"""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from testsupport.trees import describe, run_command, run_python
from testsupport.jobs import free_port, job_env, run, torchrun_cmd, train_args
from yolov9_ddp.comm import DEFAULT_TIMEOUT_S
from yolov9_ddp.demo_data import DemoSpec
from yolov9_ddp.tasks import TASKS

pytestmark = pytest.mark.timeout(600)

# Defaults of upstream flags that differ on purpose (documented in yolov9_ddp/cli.py): without --data the kit
# trains on its generated demo dataset instead of COCO; --hyp and the segment scripts' --weights name files that
# upstream does not ship (hyp.scratch-low.yaml, yolo-seg.pt).
DEFAULT_ALLOWLIST = {'detect': {'data', 'hyp'}, 'detect-dual': {'data'}, 'detect-triple': {'data'},
                     'segment': {'data', 'hyp', 'weights'}, 'segment-dual': {'data', 'hyp', 'weights'}}
PROGRESS_BAR_MARKS = ('█', '%|', '\r')


# -- 1. every upstream flag, same meaning ------------------------------------------------------------------------------

PARSERS = r'''
import argparse, json, sys
from pathlib import Path

tree = Path.cwd().resolve()
tasks = json.loads(sys.argv[1])  # {task: [upstream module, samples]}


def norm(value):
    """Paths relative to the tree root (upstream's ROOT is relative to the cwd, ours absolute)."""
    if isinstance(value, Path):
        return 'ROOT/' + (tree / value).resolve().relative_to(tree).as_posix()
    if isinstance(value, (list, tuple)):
        return [norm(v) for v in value]
    return value


def dump(parser):
    return [{'option_strings': a.option_strings, 'dest': a.dest,
             'type': None if a.type is None else getattr(a.type, '__name__', repr(a.type)),
             'nargs': a.nargs, 'const': repr(a.const), 'default': str(norm(a.default)),
             'choices': None if a.choices is None else list(a.choices), 'required': a.required,
             'action': type(a).__name__} for a in parser._actions]


def upstream_parser(module):
    """The parser upstream's script builds in parse_opt(), captured where it would parse."""
    captured = []
    parser = argparse.ArgumentParser
    real_parse_args, real_parse_known_args = parser.parse_args, parser.parse_known_args
    argparse.ArgumentParser.parse_args = lambda self, *a, **k: captured.append(self) or argparse.Namespace()
    argparse.ArgumentParser.parse_known_args = \
        lambda self, *a, **k: (captured.append(self), (argparse.Namespace(), []))[1]
    sys.argv = ['x']
    try:
        importlib.import_module(module).parse_opt()  # upstream's, from this (patched) tree
    finally:
        argparse.ArgumentParser.parse_args = real_parse_args
        argparse.ArgumentParser.parse_known_args = real_parse_known_args
    return captured[-1]


def compared(task, module, samples):
    upstream, ours = upstream_parser(module), build_parser(tree, TASKS[task])
    parsed = [{'upstream': {k: norm(v) for k, v in vars(upstream.parse_args(s)).items()},
               'ours': {k: norm(v) for k, v in vars(ours.parse_args(s)).items()}} for s in samples]
    kit = [o for group in ours._action_groups if group.title == 'yolov9-ddp' for a in group._group_actions
           for o in a.option_strings]
    return {'upstream': dump(upstream), 'ours': dump(ours), 'parsed': parsed, 'kit': kit}


import importlib  # noqa: E402

from yolov9_ddp.cli import build_parser  # noqa: E402
from yolov9_ddp.tasks import TASKS  # noqa: E402

print(json.dumps({task: compared(task, module, samples) for task, (module, samples) in tasks.items()}))
'''

# Command lines that set every upstream flag to something other than its default, and the other spellings.
DETECT_SAMPLES = [
    ['--weights', 'w.pt', '--cfg', 'm.yaml', '--data', 'd.yaml', '--hyp', 'h.yaml', '--epochs', '3',
     '--batch-size', '8', '--img', '320', '--rect', '--resume', '--nosave', '--noval', '--noautoanchor', '--noplots',
     '--evolve', '--bucket', 'b', '--cache', '--image-weights', '--device', '0,1', '--multi-scale', '--single-cls',
     '--optimizer', 'AdamW', '--sync-bn', '--workers', '2', '--project', 'p', '--name', 'n', '--exist-ok', '--quad',
     '--cos-lr', '--flat-cos-lr', '--fixed-lr', '--label-smoothing', '0.1', '--patience', '7', '--freeze', '1', '2',
     '--save-period', '5', '--seed', '3', '--local_rank', '1', '--min-items', '2', '--close-mosaic', '4',
     '--entity', 'e', '--upload_dataset', '--bbox_interval', '3', '--artifact_alias', 'v1'],
    ['--data', 'd.yaml', '--img-size', '256', '--resume', 'runs/train/exp/weights/last.pt', '--evolve', '10',
     '--cache', 'disk', '--upload_dataset', 'val', '--local-rank', '0', '--freeze', '10'],
    ['--data', 'd.yaml', '--imgsz', '512', '--batch-size', '-1'],
]
# train_triple.py has no --flat-cos-lr and --fixed-lr; the segment scripts neither, nor --min-items and the logger
# flags, but --mask-ratio and --no-overlap
ONLY_SOME = {'--flat-cos-lr', '--fixed-lr', '--min-items', '--entity', '--upload_dataset', '--bbox_interval',
             '--artifact_alias'}


def samples_of(task) -> list:
    """DETECT_SAMPLES without the flags the task's upstream script lacks (with their values), plus its own."""
    lacks = set() if task.flat_and_fixed_lr else {'--flat-cos-lr', '--fixed-lr'}
    if task.masks:
        lacks = ONLY_SOME
    samples = []
    for sample in DETECT_SAMPLES:
        kept, skipping = [], False
        for token in sample:
            if token.startswith('--'):
                skipping = token in lacks
            if not skipping:
                kept.append(token)
        samples.append(kept + (['--mask-ratio', '2', '--no-overlap'] if task.masks and sample is DETECT_SAMPLES[0]
                               else []))
    return samples


@pytest.fixture(scope='module', params=list(TASKS))
def task(request):
    return TASKS[request.param]


@pytest.fixture(scope='module')
def every_parser(patched_tree, tmp_path_factory) -> dict:
    """{task: what PARSERS found}: one process imports the five upstream scripts and compares their parsers."""
    from testsupport.trees import offline_environment
    env = offline_environment(tmp_path_factory.mktemp('home'))
    tasks = {name: [task.upstream.removesuffix('.py').replace('/', '.'), samples_of(task)]
             for name, task in TASKS.items()}
    result = run_python(PARSERS, patched_tree, env, args=[json.dumps(tasks)], timeout=120)
    assert result.returncode == 0, describe(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def parsers(every_parser, task):
    return every_parser[task.name]


def by_option(actions):
    return {option: action for action in actions for option in action['option_strings']}


@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
def test_every_upstream_flag_is_accepted_with_the_same_definition(parsers, task):
    upstream, ours = parsers['upstream'], by_option(parsers['ours'])
    assert len(upstream) > 35  # the parser object was captured, not an empty stand-in
    for action in upstream:
        for option in action['option_strings']:
            assert option in ours, f'{option} of {task.upstream} is missing'
            mine = ours[option]
            for key in ('dest', 'type', 'nargs', 'const', 'choices', 'required', 'action'):
                assert mine[key] == action[key], f'{option}: {key} is {mine[key]!r}, upstream {action[key]!r}'
            if action['dest'] not in DEFAULT_ALLOWLIST[task.name]:
                assert mine['default'] == action['default'], \
                    f'{option}: default {mine["default"]!r}, upstream {action["default"]!r}'
    # the allowlisted differences are the documented ones: no --data means the demo dataset, the hyp file shipped
    assert ours['--data']['default'] == 'None' and by_option(upstream)['--data']['default'].startswith('ROOT/data/')
    assert ours['--hyp']['default'] == 'ROOT/data/hyps/hyp.scratch-high.yaml'
    # and the kit accepts no upstream-looking flag its script lacks: the kit's own flags are the only extras
    assert set(ours) - set(by_option(upstream)) == set(parsers['kit'])


def test_every_upstream_flag_parses_to_the_same_value(parsers, task):
    upstream_dests = {a['dest'] for a in parsers['upstream']} - {'help'}
    defaults = {a['dest']: a['default'] for a in parsers['upstream']}
    first = parsers['parsed'][0]['upstream']
    assert {d for d in upstream_dests if str(first[d]) != defaults[d]} == upstream_dests  # sample 1 sets them all
    for number, (sample, parsed) in enumerate(zip(samples_of(task), parsers['parsed'])):
        compared = upstream_dests if number == 0 else upstream_dests - DEFAULT_ALLOWLIST[task.name]  # when not given
        for dest in compared:
            assert parsed['ours'][dest] == parsed['upstream'][dest], f'{sample}: {dest}'


@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
def test_help_documents_the_kit_flags(patched_tree):
    result = run([sys.executable, 'ddp_train_dual.py', '--help'], patched_tree, timeout=120,
                 env=job_env(COLUMNS='100'))
    assert result.returncode == 0, describe(result)
    text = result.stdout
    for flag in ('--batch-size', '--local-rank'):
        assert flag in text, f'{flag} not in --help'
    entries = {}  # option -> its help entry (the option lines, not the usage summary)
    for entry in re.split(r'\n(?=  -)', text.split('\n\n', 1)[1]):
        entries[entry.split()[0].rstrip(',')] = ' '.join(entry.split())
    for flag in ('--ddp-timeout', '--auto-resume', '--demo-dir', '--levers', '--checkpoint-steps',
                 '--checkpoint-minutes'):
        assert flag in entries and len(entries[flag].split()) > 4, f'{flag} is not documented:\n{text}'
    assert f'(default: {DEFAULT_TIMEOUT_S} s' in entries['--ddp-timeout'], entries['--ddp-timeout']


# -- 3. the legacy launcher --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_legacy_torch_distributed_launch_trains(patched_tree, demo_data, tmp_path):
    project = tmp_path / 'runs'
    cmd = [sys.executable, '-m', 'torch.distributed.launch', '--nproc_per_node', '2', '--master_addr', '127.0.0.1',
           '--master_port', str(free_port()), 'ddp_train_dual.py', *map(str, train_args(demo_data, project, 1, 4, 64))]
    result = run(cmd, patched_tree, timeout=180)
    assert result.returncode == 0, describe(result)
    assert [p.name for p in project.iterdir()] == ['exp']
    assert (project / 'exp' / 'weights' / 'last.pt').is_file()
    assert '2 process(es), batch 4 (2 per process)' in result.stdout + result.stderr
    # the launcher passed --local-rank=0 to rank 0, and it was accepted (default -1)
    assert yaml.safe_load((project / 'exp' / 'opt.yaml').read_text())['local_rank'] == 0


# -- 4. the demo dataset when no --data is given -----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
def test_without_data_trains_on_the_generated_demo_dataset(patched_tree, offline_env, tmp_path):
    demo, project = tmp_path / 'demo', tmp_path / 'runs'
    before = sorted(p.name for p in patched_tree.iterdir())
    cmd = [sys.executable, 'ddp_train_dual.py', '--demo-dir', demo, '--epochs', '1', '--imgsz', '64',
           '--batch-size', '8', '--workers', '0', '--project', project]
    start = time.monotonic()
    result = run_command(cmd, patched_tree, offline_env, 180, stderr=subprocess.STDOUT)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-5000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert 'mAP50-95' in lines[-1], lines[-5:]
    spec = DemoSpec()
    assert len(list((demo / 'images' / 'train').glob('*.jpg'))) == spec.train
    assert len(list((demo / 'images' / 'val').glob('*.jpg'))) == spec.val
    opt = yaml.safe_load((project / 'exp' / 'opt.yaml').read_text())
    assert Path(opt['data']) == demo / 'data.yaml'
    assert Path(opt['cfg']).name == 'tiny-dual.yaml'  # no --cfg, no --weights: the kit's tiny model
    assert sorted(p.name for p in patched_tree.iterdir()) == before  # nothing written into the tree
    assert elapsed < 90, f'the demo run took {elapsed:.0f} s'


# -- 5, 6. who prints what, who creates the run folder -----------------------------------------------------------------

def rank_outputs(log_dir: Path) -> dict:
    """{rank: stdout + stderr} of a torchrun job run with --log-dir and --redirects 3."""
    outputs = {}
    for stderr in sorted(log_dir.rglob('stderr.log')):
        stdout = stderr.with_name('stdout.log')
        outputs[int(stderr.parent.name)] = (stdout.read_text() if stdout.is_file() else '') + stderr.read_text()
    return outputs


@pytest.fixture(scope='module')
def logged_job(patched_tree, demo_data, tmp_path_factory):
    """A 2-process job with per-rank output files, and --imgsz 70 (which makes every rank log a warning)."""
    folder = tmp_path_factory.mktemp('logged')
    project, log_dir = folder / 'runs', folder / 'logs'
    cmd = torchrun_cmd(2, 'ddp_train_dual.py', *train_args(demo_data, project, 1, 4, 70),
                       launcher=('--nnodes', '1', '--log-dir', log_dir, '--redirects', '3'))
    result = run(cmd, patched_tree, timeout=180)
    outputs = rank_outputs(log_dir)
    assert result.returncode == 0, describe(result) + json.dumps(outputs, indent=1)[-5000:]
    return {'project': project, 'outputs': outputs, 'folders': sorted(p.name for p in project.iterdir())}


@pytest.mark.slow
def test_rank_0_logs_and_shows_progress(logged_job):
    out = logged_job['outputs'][0]
    assert 'Epoch' in out and 'GPU_mem' in out
    assert '█' in out  # the progress bar
    final = [line for line in out.splitlines() if 'Final:' in line]
    assert len(final) == 1 and 'mAP50-95' in final[0]
    stripped = [line for line in out.splitlines() if 'Optimizer stripped from' in line]
    assert len(stripped) == 2 and all('weights' in line and '.tmp' not in line for line in stripped), stripped
    assert 'must be multiple of max stride 32, updating to 96' in out


@pytest.mark.cores
def test_other_ranks_print_only_warnings_and_errors_with_their_rank(logged_job):
    outputs = logged_job['outputs']
    assert sorted(outputs) == [0, 1]
    out = outputs[1]
    assert 'Epoch' not in out and 'Final:' not in out and 'mAP50-95' not in out, out[-3000:]
    for mark in PROGRESS_BAR_MARKS:
        assert mark not in out, f'progress bar output ({mark!r}) on rank 1:\n{out[-3000:]}'
    lines = [line for line in out.splitlines() if line.strip()]
    warnings = [line for line in lines if 'must be multiple of max stride 32, updating to 96' in line]
    assert warnings, f"rank 1 did not log upstream's --img-size warning; its output:\n{out[-3000:]}"
    assert all(line.startswith('[rank 1] ') for line in lines), lines


@pytest.mark.slow
def test_one_run_folder_per_run_incremented_as_upstream(logged_job, patched_tree, demo_data):
    project = logged_job['project']
    assert logged_job['folders'] == ['exp']  # 2 ranks, one folder
    assert (project / 'exp' / 'weights' / 'last.pt').is_file()
    cmd = torchrun_cmd(2, 'ddp_train_dual.py', *train_args(demo_data, project, 1, 4, 64))
    result = run(cmd, patched_tree, timeout=180)
    assert result.returncode == 0, describe(result)
    assert sorted(p.name for p in project.iterdir()) == ['exp', 'exp2']
    assert (project / 'exp2' / 'weights' / 'last.pt').is_file()
