"""The kit in the user's Python environment, and the smoke subset that .ci/run also runs on the oldest versions.

- requirements.txt holds lower bounds only, each pinned exactly by constraints/oldest.txt, where CI proves it.
- A torch below the floor, no OpenCV, or GPUs asked for where CUDA cannot start: one line, a non-zero exit, no
  traceback, in a real launch with a deadline. This machine has no GPU, so a torch CUDA build finds no driver here
  for real; an old driver, an old torch and a missing OpenCV are pretended (testsupport/pretend/sitecustomize.py).
- Rank 0's banner line, and one process without --device training on the CPU, saying why.
- Smoke (`pytest -m smoke`, run by .ci/run in .venv-oldest too): apply and revert the series, a 2-process gloo
  training and the environment messages; tests/test_faults.py adds its killed worker mid-step (resumed by
  torchrun) and its SIGTERM with --save-on-signal (continued with --resume).
"""
import re
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from testsupport.faults import error_lines
from testsupport.jobs import job_env, run, torchrun_cmd, train_args
from testsupport.trees import KIT, copy_tree, describe, run_applier, snapshot
from yolov9_ddp import environment
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset

pytestmark = pytest.mark.timeout(600)

PRETEND = Path(__file__).resolve().parents[1] / 'testsupport' / 'pretend'
DEADLINE_S = 120  # a refused launch ends in seconds; a hang fails the test here
OPENCV = {'opencv-python', 'opencv-python-headless'}  # the user's choice (docs/clone.md, "Your Python environment")
# pandas 3 requires numpy >= 2: without the bound, pip upgrades the numpy of a numpy-1 environment to add pandas
UPPER_BOUNDS = {'pandas'}


# -- the requirement files ---------------------------------------------------------------------------------------------

def requirements(path: Path) -> dict:
    """{canonical name: Requirement} of a requirements or constraints file (comments and blank lines skipped)."""
    lines = (line.split('#', 1)[0].strip() for line in path.read_text().splitlines())
    return {canonicalize_name(r.name): r for r in map(Requirement, filter(None, lines))}


def pinned(path: Path) -> dict:
    """{canonical name: Version} of a constraints file, where every line must pin one exact version."""
    pins = {}
    for name, requirement in requirements(path).items():
        (spec,) = requirement.specifier
        assert spec.operator == '==', f'{path.name}: {requirement} is not an exact pin'
        pins[name] = Version(spec.version)
    return pins


def floors() -> dict:
    """{canonical name: Version} of requirements.txt, where every line is one lower bound (and an upper bound only
    where UPPER_BOUNDS gives the reason)."""
    result = {}
    for name, requirement in requirements(KIT / 'requirements.txt').items():
        specs = list(requirement.specifier)
        lower = [s for s in specs if s.operator == '>=']
        upper = [s for s in specs if s.operator == '<']
        assert len(lower) == 1 and len(lower) + len(upper) == len(specs), f'requirements.txt: {requirement}'
        assert not upper or name in UPPER_BOUNDS, f'requirements.txt: {requirement}: an upper bound without a reason'
        result[name] = Version(lower[0].version)
    return result


def test_requirements_txt_holds_lower_bounds_only_without_test_tools_or_opencv():
    names = set(floors())
    assert {'torch', 'torchvision', 'numpy'} <= names
    test_tools = set(requirements(KIT / 'requirements-test.txt'))
    assert test_tools >= {'pytest', 'pytest-timeout', 'setuptools'}
    assert not names & (test_tools | OPENCV), 'test tools and OpenCV are not run-time requirements the kit imposes'


def test_the_oldest_constraints_pin_every_lower_bound_exactly():
    """The claim of each lower bound is what CI proves: .ci/run installs constraints/oldest.txt into .venv-oldest."""
    oldest = pinned(KIT / 'constraints' / 'oldest.txt')
    for name, floor in floors().items():
        assert oldest.get(name) == floor, f'requirements.txt says {name}>={floor}; oldest.txt pins {oldest.get(name)}'
    assert oldest['setuptools'] < Version('81'), 'the oldest environment keeps pkg_resources, as a 2024 one has'
    assert oldest['numpy'] < Version('2')


def test_the_newest_constraints_satisfy_every_requirement():
    newest = pinned(KIT / 'constraints' / 'newest.txt')
    wanted = {**requirements(KIT / 'requirements.txt'), **requirements(KIT / 'requirements-test.txt')}
    for name, requirement in wanted.items():
        assert name in newest and newest[name] in requirement.specifier, f'newest.txt: {requirement}'
    assert newest['setuptools'] >= Version('81'), 'patch 0001 is tested where setuptools ships no pkg_resources'
    assert 'opencv-python-headless' in newest and 'opencv-python' not in newest


def test_the_entry_points_torch_floor_is_the_one_of_requirements_txt():
    assert environment.TORCH_FLOOR == environment.release(str(floors()['torch']))


@pytest.mark.parametrize('version,expected', [('2.4.0+cu121', (2, 4)), ('2.14.1', (2, 14)), ('2.6.0a0+git1a2b', (2, 6)),
                                              ('1.13.1', (1, 13))])
def test_release_reads_major_and_minor(version, expected):
    assert environment.release(version) == expected


# -- launches that cannot work: one line -------------------------------------------------------------------------------

@pytest.fixture
def args(demo_data, tmp_path):
    """A 1-epoch run of the tiny model on the demo data, without --device."""
    return [str(a) for a in train_args(demo_data, tmp_path / 'runs', 1, 4, 64) if str(a) not in ('--device', 'cpu')]


def launch(tree, nproc, args, **env):
    cmd = torchrun_cmd(nproc, 'ddp_train_dual.py', *args) if nproc > 1 else [sys.executable, 'ddp_train_dual.py',
                                                                              *args]
    return run(list(map(str, cmd)), tree, timeout=DEADLINE_S, env=job_env(**env))


def pretending(what: str) -> dict:
    return {'PYTHONPATH': PRETEND, 'YOLOV9_DDP_PRETEND': what}


def the_error_line(result, *fragments) -> str:
    """A non-zero exit with exactly one error line across every process, naming each fragment, and no frame of the
    kit's script in the output (torchrun's own report of a failed worker is not ours)."""
    output = result.stdout + result.stderr
    assert result.returncode != 0, describe(result)
    lines = error_lines(output)
    assert len(lines) == 1, f'expected one error line, got {lines}\n{describe(result)}'
    for fragment in fragments:
        assert fragment in lines[0], f'{fragment!r} not in {lines[0]!r}'
    assert 'ddp_train_dual.py", line' not in output, describe(result)
    assert not re.search(r'^yolov9-ddp \S+: torch', output, re.M), 'a banner although nothing runs'
    return lines[0]


def torchs_own_reason(env: dict) -> str:
    """What torch.cuda.init() says in a process with env, cut to its first sentence ('' if CUDA starts)."""
    code = 'import torch\ntry:\n    torch.cuda.init()\nexcept Exception as e:\n    print(e)\n'
    result = run([sys.executable, '-c', code], KIT, timeout=DEADLINE_S, env=job_env(**env))
    return environment.first_sentence(result.stdout)


@pytest.mark.slow
@pytest.mark.smoke
def test_processes_without_device_cpu_where_cuda_finds_no_gpu_fail_with_one_line(patched_tree, args):
    """Real here: torch is a CUDA build and this machine has no NVIDIA driver (elsewhere CUDA_VISIBLE_DEVICES=''
    hides the GPUs). Without the check, 2 gloo processes would train on the CPU, silently."""
    hidden = {'CUDA_VISIBLE_DEVICES': ''}
    reason = torchs_own_reason(hidden)
    assert reason, 'CUDA started although CUDA_VISIBLE_DEVICES is empty'
    result = launch(patched_tree, 2, args, **hidden)
    the_error_line(result, '2 processes without --device cpu', f'torch {torch.__version__} cannot use CUDA here',
                   reason, 'add --device cpu', 'install a torch build that your NVIDIA driver supports')
    assert not Path(args[args.index('--project') + 1]).exists(), 'nothing may be written'


@pytest.mark.slow
@pytest.mark.smoke
def test_processes_without_device_cpu_under_a_too_old_driver_fail_with_one_line(patched_tree, args):
    result = launch(patched_tree, 2, args, **pretending('old-driver'))
    the_error_line(result, '2 processes without --device cpu',
                   'The NVIDIA driver on your system is too old (found version 11040)', 'add --device cpu')


@pytest.mark.slow
@pytest.mark.smoke
def test_a_torch_below_the_floor_is_refused_in_one_line(patched_tree, args):
    """Rank 0 starts late: rank 1 finds the old torch first and must not exit (torchrun would then stop rank 0)
    before rank 0 has said it."""
    result = launch(patched_tree, 2, [*args, '--device', 'cpu'], **pretending('torch=2.2.1,late-rank-0'))
    the_error_line(result, 'yolov9-ddp needs torch >= 2.4 (found 2.2.1): upgrade torch')


@pytest.mark.smoke
def test_no_opencv_is_refused_in_one_line(patched_tree, args):
    result = launch(patched_tree, 1, [*args, '--device', 'cpu'], **pretending('no-opencv'))
    the_error_line(result, 'OpenCV does not import', f'pip install {environment.opencv_for_numpy()}')


# -- the banner --------------------------------------------------------------------------------------------------------

def banner_lines(output: str) -> list:
    return re.findall(r'^yolov9-ddp \S+: torch .*$', output, re.M)


@pytest.mark.smoke
@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
def test_one_process_without_device_trains_on_the_cpu_and_says_why(patched_tree, args):
    result = launch(patched_tree, 1, args, CUDA_VISIBLE_DEVICES='')
    assert result.returncode == 0, describe(result)
    (banner,) = banner_lines(result.stdout + result.stderr)
    reason = torchs_own_reason({'CUDA_VISIBLE_DEVICES': ''})
    assert f'devices cpu (no usable GPU: {reason})' in banner, banner
    assert banner.endswith('backend none (one process), world size 1'), banner


# -- smoke: what .ci/run also proves on the oldest versions ------------------------------------------------------------
# With these, tests/test_faults.py's killed worker mid-step and SIGTERM with --save-on-signal (the same 2-epoch jobs
# that were repeated here) are marked smoke: a worker killed mid-epoch resumed by torchrun, a run stopped by SIGTERM
# continued with --resume.

@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
    """48 training images: 12 steps per epoch on each of 2 ranks at batch 4, room for a fault mid-epoch."""
    return ensure_demo_dataset(tmp_path_factory.mktemp('smoke') / 'demo', DemoSpec(train=48, val=16, imgsz=64))


@pytest.mark.smoke
def test_the_series_applies_to_the_pinned_tree_and_reverts_to_its_bytes(pinned_upstream, tmp_path):
    tree = copy_tree(pinned_upstream, tmp_path / 'yolov9')
    applied = run_applier(tree)
    assert applied.returncode == 0, describe(applied)
    assert snapshot(tree) != snapshot(pinned_upstream)
    reverted = run_applier(tree, '--revert')
    assert reverted.returncode == 0, describe(reverted)
    assert snapshot(tree) == snapshot(pinned_upstream)


@pytest.mark.smoke
@pytest.mark.slow
def test_two_gloo_processes_train_two_epochs_and_rank_0_prints_the_banner(patched_tree, dataset, tmp_path):
    project = tmp_path / 'runs'
    result = run(torchrun_cmd(2, 'ddp_train_dual.py', *train_args(dataset, project, 2, 4, 64)), patched_tree,
                 timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, describe(result)
    assert 'Final:' in output and (project / 'exp' / 'weights' / 'best.pt').is_file(), describe(result)
    (banner,) = banner_lines(output)
    cuda = f'CUDA {torch.version.cuda}' if torch.version.cuda else 'no CUDA'
    assert f': torch {torch.__version__} ({cuda}), devices cpu (--device cpu), backend gloo, world size 2' in banner
