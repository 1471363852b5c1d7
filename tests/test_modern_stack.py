"""The patched upstream on today's stack: torch 2.14, numpy 2.x, setuptools >= 81 (no pkg_resources),
Pillow >= 10, no IPython, no network.

First, upstream's own train_dual.py trains the kit's tiny model end to end in the patched tree. Then
one focused probe per fix: the same few lines run in a tree that lacks the fix (the pristine tree, or
the series minus that one patch where the pristine tree would fail earlier for another reason) and in
the patched tree, and must fail in the first and work in the second.
"""
import csv
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from testsupport.trees import TINY_CFG, describe, offline_environment, run_command, run_python
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset

# One process at a time (upstream's scripts): a slow test here may share the 2 cores with another test.
pytestmark = pytest.mark.one_core
TRAIN_TIMEOUT_S = 600
BLOCKED = 'network blocked by the yolov9-ddp tests'


def probe(tree: Path, code: str, env: dict, args=()) -> subprocess.CompletedProcess:
    return run_python(textwrap.dedent(code), tree, env, args=args)


def assert_fails(result, *fragments):
    assert result.returncode != 0, f'expected the probe to fail:\n{describe(result)}'
    for fragment in fragments:
        assert fragment in result.stderr, f'{fragment!r} not in the error:\n{describe(result)}'


def assert_works(result, expected_last_line='ok'):
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip().splitlines()[-1] == expected_last_line, describe(result)


def assert_fix(without_fix: Path, patched: Path, code: str, env: dict, failure, args=(), expected='ok'):
    """The probe fails without the fix (stderr naming each fragment of `failure`) and works patched."""
    assert_fails(probe(without_fix, code, env, args), *failure)
    assert_works(probe(patched, code, env, args), expected)


# -- the environment and the end-to-end training run --------------------------------------------

ENVIRONMENT_FACTS = '''
import importlib.metadata as md, importlib.util, json, socket
import numpy, PIL, torch
print(json.dumps({
    'torch': torch.__version__.split('+')[0], 'numpy': numpy.__version__, 'pillow': PIL.__version__,
    'setuptools': md.version('setuptools'),
    'pkg_resources': importlib.util.find_spec('pkg_resources') is not None,
    'ipython': importlib.util.find_spec('IPython') is not None,
    'network_blocked': getattr(socket, 'NETWORK_BLOCKED_BY_YOLOV9_DDP_TESTS', False)}))
'''


def version(text: str) -> tuple:
    return tuple(int(part) for part in text.split('.')[:2])


def test_the_environment_is_the_modern_stack(offline_env, tmp_path):
    result = run_python(ENVIRONMENT_FACTS, tmp_path, offline_env)
    assert result.returncode == 0, describe(result)
    facts = json.loads(result.stdout)
    assert facts['torch'] == '2.14.1'
    assert version(facts['numpy']) >= (2, 0)
    assert version(facts['pillow']) >= (10, 0)
    assert version(facts['setuptools']) >= (81, 0)
    assert facts['pkg_resources'] is False, 'pkg_resources is importable: the setuptools >= 81 claim is untested'
    assert facts['ipython'] is False, 'IPython is importable: training without it is untested'
    assert facts['network_blocked'] is True


CHECKPOINT_CHECK = '''
import sys, torch
from models.experimental import attempt_load
for weights in sys.argv[1:]:
    ckpt = torch.load(weights, map_location='cpu', weights_only=False)
    assert ckpt['optimizer'] is None and ckpt['epoch'] == -1, 'not stripped by strip_optimizer'
    model = attempt_load(weights, device='cpu')
    out = model(torch.zeros(1, 3, 64, 64))
    print(type(ckpt['model']).__name__, type(model).__name__, sum(p.numel() for p in model.parameters()))
print('ok')
'''


@pytest.mark.slow
def test_train_dual_trains_two_epochs_offline_and_writes_its_outputs(patched_tree, demo_data, offline_env,
                                                                      tmp_path):
    project = tmp_path / 'runs'
    cmd = [sys.executable, 'train_dual.py', '--data', str(demo_data), '--cfg', str(TINY_CFG),
           '--hyp', 'data/hyps/hyp.scratch-high.yaml', '--epochs', '2', '--batch-size', '8', '--imgsz', '64',
           '--device', 'cpu', '--workers', '0', '--project', str(project), '--name', 'exp']
    result = run_command(cmd, patched_tree, offline_env, TRAIN_TIMEOUT_S)
    assert result.returncode == 0, describe(result)
    output = result.stdout + result.stderr
    run = project / 'exp'
    for name in ('weights/last.pt', 'weights/best.pt', 'results.csv', 'results.png', 'labels.jpg',
                 'confusion_matrix.png', 'val_batch0_pred.jpg'):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, f'{name} missing:\n{describe(result)}'
    with open(run / 'results.csv') as f:
        rows = [{k.strip(): v.strip() for k, v in row.items()} for row in csv.DictReader(f)]
    assert [int(row['epoch']) for row in rows] == [0, 1]
    assert all(row['metrics/mAP_0.5'] != '' for row in rows)
    # one validation summary per epoch, plus the final validation of best.pt
    assert output.count('                   all         16') >= 3, describe(result)
    assert 'torch.cuda.amp' not in output, 'a deprecated torch.cuda.amp call ran during training'
    assert not list(Path(offline_env['YOLOV5_CONFIG_DIR']).iterdir()), 'something was downloaded or cached'

    loaded = run_python(CHECKPOINT_CHECK, patched_tree, offline_env,
                        args=[run / 'weights' / 'last.pt', run / 'weights' / 'best.pt'])
    assert_works(loaded)
    assert loaded.stdout.count('DetectionModel DetectionModel') == 2, describe(loaded)


# -- one probe per fix ---------------------------------------------------------------------------

HIDE = 'import sys; sys.modules[{name!r}] = None  # as if not installed, whatever this environment has\n'


@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
def test_0001_utils_general_works_without_pkg_resources(pristine_tree, patched_tree, offline_env, tmp_path):
    requirements = tmp_path / 'requirements.txt'
    requirements.write_text('numpy>=1.0  # a comment\n\nPillow>=10.0\n')
    # The pristine utils/general.py imports IPython before pkg_resources (and 0002 does not apply without
    # 0001), so an empty stand-in module lets the probe reach the pkg_resources import there.
    code = HIDE.format(name='pkg_resources') + '''
import types
sys.modules.setdefault('IPython', types.ModuleType('IPython'))
from utils.general import check_requirements, check_version, requirement_met
assert check_version('2.0', '1.0') and not check_version('1.0', '2.0')
assert check_version('1.0', '1.0', pinned=True) and not check_version('1.1', '1.0', pinned=True)
assert requirement_met('numpy>=1.0') and not requirement_met('numpy<1.0')
assert not requirement_met('no-such-distribution-yolov9-ddp>=1')
check_requirements(sys.argv[1], install=False)
check_requirements('numpy>=1.0', install=False)
print('ok')
'''
    assert_fix(pristine_tree, patched_tree, code, offline_env, ['ModuleNotFoundError', 'import pkg_resources'],
               args=[requirements])


def test_0019_wandb_logs_in_its_offline_mode(tree_without, patched_tree, offline_env, tmp_path):
    """The real wandb, offline (no server, no account): its login answers False, and the loggers turned W&B off."""
    code = '''
import utils.loggers
assert utils.loggers.wandb is not None, 'W&B turned off in its offline mode'
print('ok')
'''
    env = {**offline_env, 'WANDB_MODE': 'offline', 'RANK': '0', 'WANDB_DIR': str(tmp_path),
           'WANDB_CONFIG_DIR': str(tmp_path), 'WANDB_CACHE_DIR': str(tmp_path)}
    assert_fix(tree_without(19), patched_tree, code, env, ['W&B turned off in its offline mode'])


@pytest.mark.slow
def test_0002_models_common_imports_without_ipython(tree_without, patched_tree, offline_env):
    code = HIDE.format(name='IPython') + '''
import models.common, utils.general
assert utils.general.is_notebook() is False
print('ok')
'''
    assert_fix(tree_without(2), patched_tree, code, offline_env, ['ModuleNotFoundError', 'IPython'])


@pytest.mark.slow
def test_0003_fonts_resolve_locally_without_network(tree_without, patched_tree, demo_data, offline_env):
    code = '''
import os, sys
from pathlib import Path
from utils.general import CONFIG_DIR, check_dataset, check_font
assert CONFIG_DIR == Path(os.environ['YOLOV5_CONFIG_DIR']) and not any(CONFIG_DIR.iterdir()), 'no font cached'
check_dataset(sys.argv[1])
assert Path(check_font('Arial.ttf')).is_file()
from PIL import ImageFont
from utils.plots import check_pil_font
font = check_pil_font()
assert isinstance(font, ImageFont.FreeTypeFont) and Path(font.path).is_file(), font
print('ok')
'''
    assert_fix(tree_without(3), patched_tree, code, offline_env, ['URLError', BLOCKED], args=[demo_data])


@pytest.mark.slow
def test_0004_box_labels_are_measured_with_getbbox(tree_without, patched_tree, offline_env):
    code = '''
import numpy as np
from utils.plots import Annotator
annotator = Annotator(np.zeros((64, 96, 3), np.uint8), line_width=1, pil=True)
annotator.box_label([10, 30, 60, 60], 'label')
annotator.text([5, 20], 'text', anchor='bottom')
assert annotator.result().any(), 'nothing was drawn'
print('ok')
'''
    assert_fix(tree_without(4), patched_tree, code, offline_env, ["no attribute 'getsize'"])


@pytest.mark.slow
def test_0005_checkpoints_load_with_weights_only_false(tree_without, patched_tree, offline_env, tmp_path):
    code = '''
import sys, torch
from copy import deepcopy
from models.experimental import attempt_load
from models.yolo import Model
from utils.general import strip_optimizer
model = Model(sys.argv[1], ch=3, nc=3)
# what train_dual.py saves as last.pt / best.pt
torch.save({'epoch': 0, 'best_fitness': 0.0, 'model': deepcopy(model).half(), 'ema': deepcopy(model).half(),
            'updates': 1, 'optimizer': torch.optim.SGD(model.parameters(), lr=0.01).state_dict(), 'opt': {},
            'git': None, 'date': None}, sys.argv[2])
strip_optimizer(sys.argv[2])
loaded = attempt_load(sys.argv[2], device='cpu')
assert type(loaded).__name__ == 'DetectionModel'
print('ok')
'''
    weights = tmp_path / 'last.pt'
    assert_fix(tree_without(5), patched_tree, code, offline_env, ['Weights only load failed'],
               args=[TINY_CFG, weights])


TRAINING_SCRIPTS = ('train.py', 'train_dual.py', 'train_triple.py', 'segment/train.py', 'segment/train_dual.py',
                    'panoptic/train.py')


FINE_TUNES = '''
import json, runpy, sys, traceback
import torch
from models.yolo import Model
cfg, weights, project, scripts, common = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5:]
torch.save({"model": Model(cfg, ch=3, nc=3)}, weights)  # a checkpoint of the tiny model, as a fine-tune reads it
for script in scripts:
    print(f'### fine-tune with {script}', file=sys.stderr, flush=True)
    sys.argv = [script, '--weights', weights, '--project', f'{project}/{script.replace("/", "-")}', *common]
    try:
        runpy.run_path(script, run_name='__main__')
        print('### it trained', file=sys.stderr, flush=True)
    except BaseException:
        traceback.print_exc()
'''


@pytest.fixture(scope='module')
def fine_tunes_without_0005(tree_without, demo_data, tmp_path_factory) -> dict:
    """{script: its output}: every training script fine-tunes from a checkpoint of the tiny model in the tree without
    patch 0005, all in one process (each would spend 5 s importing torch and upstream's modules)."""
    folder = tmp_path_factory.mktemp('fine-tunes')
    common = ['--data', demo_data, '--cfg', TINY_CFG, '--epochs', 1, '--hyp', 'data/hyps/hyp.scratch-high.yaml',
              '--imgsz', 64, '--device', 'cpu']
    result = run_python(FINE_TUNES, tree_without(5), offline_environment(folder / 'home'), timeout=TRAIN_TIMEOUT_S,
                        args=[TINY_CFG, folder / 'last.pt', folder, json.dumps(TRAINING_SCRIPTS), *common])
    assert result.returncode == 0, describe(result)
    runs = result.stderr.split('### fine-tune with ')[1:]
    return {run.split('\n', 1)[0]: run for run in runs}


@pytest.mark.slow
@pytest.mark.parametrize('script', TRAINING_SCRIPTS)
def test_0005_training_scripts_fine_tune_from_a_checkpoint(script, fine_tunes_without_0005):
    # Without the fix --weights fails at its torch.load, before any training; tests/test_upstream_scripts.py
    # fine-tunes every script from a checkpoint in the patched tree.
    output = fine_tunes_without_0005[script]
    assert '### it trained' not in output, output[-3000:]
    for fragment in ('Weights only load failed', f'{script}", line'):
        assert fragment in output, f'{fragment!r} not in the fine-tune\'s output:\n{output[-3000:]}'


# numpy 1.x, emulated in the installed numpy 2: np.trapezoid hidden, np.trapz the same function, counting its calls.
NUMPY_1 = '''
import numpy as np
integrate, calls = np.trapezoid, []
del np.trapezoid  # numpy 1.x has no np.trapezoid


def trapz(*args, **kwargs):
    calls.append(args)
    return integrate(*args, **kwargs)


np.trapz = trapz
'''
# Envelope through (0, 1), (0.2, 1), (0.6, 0.5), (1, 0), every corner on the 101-point grid:
# area = 0.2 * 1 + 0.4 * (1 + 0.5) / 2 + 0.4 * 0.5 / 2 = 0.2 + 0.3 + 0.1 = 0.6, exactly by trapezoids.
AVERAGE_PRECISION = '''
import warnings
import numpy as np
from utils.metrics import compute_ap
warnings.simplefilter('error', DeprecationWarning)  # numpy 2.0-2.3 deprecate np.trapz; 2.4 removed it
ap, _, _ = compute_ap(np.array([0.2, 0.6]), np.array([1.0, 0.5]))
print(repr(round(float(ap), 12)))
'''


@pytest.mark.slow
@pytest.mark.one_core  # one process at a time
def test_0006_average_precision_is_integrated_with_trapezoid_on_numpy_2(tree_without, patched_tree, offline_env):
    assert not hasattr(np, 'trapz'), 'this numpy still has np.trapz: the numpy 2 claim is untested'
    assert_fix(tree_without(6), patched_tree, AVERAGE_PRECISION, offline_env, ['trapz'], expected='0.6')


def test_0006_average_precision_is_integrated_with_trapz_on_numpy_1(patched_tree, offline_env):
    # np.trapezoid alone would fail here ("module 'numpy' has no attribute 'trapezoid'"): 0006 must fall back.
    code = NUMPY_1 + AVERAGE_PRECISION + 'assert len(calls) == 1, calls\nprint("ok")\n'
    result = probe(patched_tree, code, offline_env)
    assert_works(result)
    assert result.stdout.split() == ['0.6', 'ok'], describe(result)


@pytest.mark.slow
def test_0007_amp_uses_the_torch_amp_api(tree_without, patched_tree, offline_env):
    # What a training step runs: each TAL loss's VarifocalLoss and autobatch's autocast; and AutoShape (hubconf.py).
    code = '''
import importlib, sys, warnings, numpy as np, torch
from models.common import AutoShape
from models.yolo import Model
from utils.autobatch import check_train_batch_size
warnings.simplefilter('error', FutureWarning)
torch.manual_seed(0)
gt = torch.rand(2, 8, 3)
for module in ('utils.loss_tal', 'utils.loss_tal_dual', 'utils.loss_tal_triple', 'utils.segment.loss_tal',
               'utils.segment.loss_tal_dual', 'utils.panoptic.loss_tal'):
    loss = importlib.import_module(module).VarifocalLoss()(torch.randn(2, 8, 3), gt, (gt > 0.5).float())
    assert torch.isfinite(loss)
assert check_train_batch_size(torch.nn.Conv2d(3, 8, 3), imgsz=64, amp=False) == 16  # CPU: the default
model = AutoShape(Model(sys.argv[1], ch=3, nc=3).eval())
assert len(model(np.zeros((64, 64, 3), np.uint8), size=64).pred) == 1
print('ok')
'''
    assert_fix(tree_without(7), patched_tree, code, offline_env, ['FutureWarning', 'torch.cuda.amp'], args=[TINY_CFG])


LOCAL_RANK_SCRIPTS = (*TRAINING_SCRIPTS, 'classify/train.py')
LOCAL_RANK_PARSES = '''
import contextlib, importlib, io, json, sys

def parses(module, argv, expected):
    """'ok', or why the script's parse_opt() does not read argv as the local rank `expected`."""
    sys.argv, err = ['script', *argv], io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rank = importlib.import_module(module).parse_opt().local_rank
    except SystemExit:
        return err.getvalue().strip() or 'exit'
    return 'ok' if rank == expected else f'local_rank {rank}'

print(json.dumps([{'hyphen': parses(m, ['--local-rank=0'], 0),  # what torch.distributed.launch passes today
                   'underscore': parses(m, ['--local_rank', '1'], 1)} for m in sys.argv[1:]]))  # the old spelling
'''


@pytest.fixture(scope='module')
def local_rank_parsed(tree_without, patched_tree, tmp_path_factory) -> dict:
    """{'without': {script: {'hyphen': 'ok' or argparse's error, 'underscore': ...}}, 'patched': ...}: one process
    per tree imports every training script and parses both spellings of the local rank."""
    env = offline_environment(tmp_path_factory.mktemp('local-rank') / 'home')
    modules = [script.removesuffix('.py').replace('/', '.') for script in LOCAL_RANK_SCRIPTS]

    def parsed(tree: Path) -> dict:
        result = probe(tree, LOCAL_RANK_PARSES, env, args=modules)
        assert result.returncode == 0, describe(result)
        return dict(zip(LOCAL_RANK_SCRIPTS, json.loads(result.stdout.strip().splitlines()[-1])))
    return {'without': parsed(tree_without(8)), 'patched': parsed(patched_tree)}


@pytest.mark.slow
@pytest.mark.parametrize('script', LOCAL_RANK_SCRIPTS)
def test_0008_training_scripts_accept_local_rank_with_a_hyphen(script, local_rank_parsed):
    without, patched = local_rank_parsed['without'][script], local_rank_parsed['patched'][script]
    assert 'unrecognized arguments: --local-rank=0' in without['hyphen'], without
    assert patched == {'hyphen': 'ok', 'underscore': 'ok'}, patched


# -- 0010: the label cache -----------------------------------------------------------------------

BUILD_CACHE = '''
import sys
from utils.dataloaders import LoadImagesAndLabels
dataset = LoadImagesAndLabels(sys.argv[1], img_size=64, batch_size=4)
print(len(dataset))
'''

# Two writers of one label cache, interleaved the way two nodes' local rank 0 can interleave on a
# shared filesystem: A writes its cache file, B starts writing its own, A moves its file into place,
# a reader (the test) loads the cache, then B finishes. np.save is wrapped to pause at those points.
RACE_DRIVER = '''
import io, os, sys, time
from pathlib import Path
import numpy as np
from utils.dataloaders import LoadImagesAndLabels

role, sync, images = sys.argv[1], Path(sys.argv[2]), sys.argv[3]


def signal(name):
    (sync / name).touch()


def wait(name):
    deadline = time.monotonic() + 120
    while not (sync / name).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f'{role}: timed out waiting for {name}')
        time.sleep(0.01)


dataset = LoadImagesAndLabels(images, img_size=64, batch_size=4)  # the cache exists: it is only read
cache = Path(dataset.label_files[0]).parent.with_suffix('.cache')
real_save = np.save


def paused_save(file, arr, *args, **kwargs):
    buffer = io.BytesIO()
    real_save(buffer, arr, *args, **kwargs)
    data = buffer.getvalue()
    named = isinstance(file, (str, os.PathLike))  # np.save opens (truncates) a path itself, adding .npy
    if role == 'B':
        wait('a-written')  # before opening: B must truncate the file after A has written it
    f = open(os.fspath(file) + ('' if os.fspath(file).endswith('.npy') else '.npy'), 'wb') if named else file
    if role == 'A':
        f.write(data)
        f.flush()
        signal('a-written')
        wait('b-half-written')
    else:
        f.write(data[:len(data) // 2])
        f.flush()
        signal('b-half-written')
        wait('reader-done')
        f.write(data[len(data) // 2:])
        f.flush()
    if named:
        f.close()


np.save = paused_save
dataset.cache_labels(cache, prefix=f'{role}: ')
print('ok')
'''


def load_cache(path: Path):
    """The label cache dict, or the exception loading it raises."""
    try:
        return np.load(path, allow_pickle=True).item()
    except Exception as e:  # a partly written file: EOFError, UnpicklingError, ValueError...
        return e


def leftover_files(labels: Path) -> list:
    return sorted(p.name for p in labels.iterdir() if p.name not in ('train', 'val', 'train.cache'))


def race_label_cache_writers(tree: Path, images: Path, env: dict, sync: Path):
    """Run writers A and B as above; returns (what the reader loaded between them, A's and B's results)."""
    sync.mkdir()
    writers = {role: subprocess.Popen([sys.executable, '-c', RACE_DRIVER, role, str(sync), str(images)],
                                      cwd=str(tree), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for role in 'AB'}
    try:
        out_a = writers['A'].communicate(timeout=180)  # A has moved its file into place and exited
        seen = load_cache(images.parent.parent / 'labels' / 'train.cache')
    finally:
        (sync / 'reader-done').touch()
    out_b = writers['B'].communicate(timeout=180)
    return seen, [subprocess.CompletedProcess(writers[role].args, writers[role].returncode, *out)
                  for role, out in zip('AB', (out_a, out_b))]


@pytest.mark.slow
@pytest.mark.timed  # two writers and a reader, timed against each other
@pytest.mark.parametrize('fixed', [False, True], ids=['without-0010', 'patched'])
def test_0010_label_cache_is_never_seen_half_written(fixed, tree_without, patched_tree, offline_env, tmp_path):
    tree = patched_tree if fixed else tree_without(10)
    root = ensure_demo_dataset(tmp_path / 'data', DemoSpec(train=16, val=4, imgsz=64), log=lambda msg: None).parent
    images, labels = root / 'images' / 'train', root / 'labels'

    built = run_python(BUILD_CACHE, tree, offline_env, args=[images])
    assert built.returncode == 0 and built.stdout.strip() == '16', describe(built)
    first = load_cache(labels / 'train.cache')
    assert isinstance(first, dict) and len([k for k in first if k.endswith('.jpg')]) == 16, first
    assert leftover_files(labels) == [], 'building the cache left a temporary file'

    seen, writers = race_label_cache_writers(tree, images, offline_env, tmp_path / 'sync')
    for writer in writers:
        assert writer.returncode == 0 and writer.stdout.strip() == 'ok', describe(writer)
    final = load_cache(labels / 'train.cache')
    assert isinstance(final, dict) and final['hash'] == first['hash'], final
    assert leftover_files(labels) == [], 'the concurrent writers left a temporary file'
    half_written = not isinstance(seen, dict)
    assert half_written is not fixed, \
        f'{"patched" if fixed else "unpatched"}: the reader between the writers loaded {seen!r:.200}'


# -- 0013: no pip install at run time ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_0013_missing_requirements_are_reported_not_installed(tree_without, patched_tree, offline_env):
    # What segment/predict.py, classify/*.py and hubconf.py call; pip must not run (check_output is its only caller).
    code = '''
import utils.general
calls = []
utils.general.check_output = lambda *args, **kwargs: calls.append(args) or b''
utils.general.check_requirements(['no-such-distribution-yolov9-ddp>=1'])
assert not calls, f'pip was run: {calls}'
print('ok')
'''
    assert_fails(probe(tree_without(13), code, offline_env), 'pip was run', 'no-such-distribution-yolov9-ddp')
    reported = probe(patched_tree, code, offline_env)
    assert_works(reported)
    assert 'not found: pip install "no-such-distribution-yolov9-ddp>=1"' in reported.stdout + reported.stderr


# -- 0014: plots finish before the process exits -----------------------------------------------------------------------

def test_0014_a_plot_drawn_in_a_thread_is_written_before_the_process_exits(tree_without, patched_tree, offline_env,
                                                                          tmp_path):
    # upstream's @threaded plot functions run in daemon threads, abandoned (or aborting the process) at exit
    code = '''
import sys, time
from pathlib import Path
from utils import threaded

@threaded
def slow_plot(path):
    time.sleep(1.0)
    Path(path).write_text('plotted')

slow_plot(sys.argv[1])
print('ok')
'''
    for name, tree, written in (('without', tree_without(14), False), ('with', patched_tree, True)):
        plot = tmp_path / f'{name}.txt'
        assert_works(probe(tree, code, offline_env, args=[plot]))
        assert plot.exists() == written, f'{name} the patch: the plot was {"" if plot.exists() else "not "}written'


# -- 0015: seaborn is imported where the labels are plotted, not at every start ----------------------------------------

@pytest.mark.slow
@pytest.mark.one_core
def test_0015_seaborn_is_imported_only_to_plot_the_labels(tree_without, patched_tree, offline_env, tmp_path):
    # models.yolo imports utils.plots, which in upstream imports seaborn (and scipy with it) at every process's start
    code = '''
import sys
from pathlib import Path
import numpy as np
import models.yolo, utils.plots
assert 'seaborn' not in sys.modules, 'seaborn is imported at start'
labels = np.array([[0, 0.5, 0.5, 0.2, 0.3], [1, 0.3, 0.6, 0.1, 0.1], [1, 0.7, 0.2, 0.3, 0.2]], dtype=np.float32)
utils.plots.plot_labels(labels, {0: 'a', 1: 'b'}, Path(sys.argv[1]))
assert (Path(sys.argv[1]) / 'labels.jpg').is_file() and (Path(sys.argv[1]) / 'labels_correlogram.jpg').is_file()
print('ok')
'''
    assert_fix(tree_without(15), patched_tree, code, offline_env, ['seaborn is imported at start'], args=[tmp_path])


# -- 0016 and 0017: the detection losses reach their box loss without waiting for the GPU ---------------------------

LOSSES_ON_META = """
import hashlib, json, sys, traceback
import torch, yaml
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from models.yolo import Model
HYP = yaml.safe_load(open('data/hyps/hyp.scratch-high.yaml'))
TARGETS = {  # the loader's, on the host: boxes apart, boxes that share anchors, none
    'apart': [[0, 1, .5, .5, .2, .2], [1, 0, .3, .3, .1, .1], [1, 1, .6, .6, .2, .1]],
    'overlapping': [[0, 1, .5, .5, .4, .4], [0, 0, .55, .5, .4, .3], [1, 1, .6, .6, .2, .1]],
    'none': []}


def loss_of(module, cfg, device):
    torch.manual_seed(0)
    model = Model(cfg, ch=3, nc=2)
    model.hyp = HYP
    loss = __import__(module, fromlist=['ComputeLoss']).ComputeLoss(model.to(device))
    if DENSE:
        from yolov9_ddp import boxloss
        boxloss.weigh_every_anchor(loss)
    return model, loss


class BlockingCopiesFail(TorchFunctionMode):
    # meta takes host data into its ops silently, where a GPU first copies it over and waits for the copy
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if copies_host_data_blocking(func, args, kwargs, result):
            raise RuntimeError(f'{func.__name__}: a blocking copy of host data to the device')
        return result


def copies_host_data_blocking(func, args, kwargs, result) -> bool:
    # a host tensor beside a device tensor, a list used as an index, torch.tensor(..., device=...), a blocking
    # .to(device). A host scalar is a kernel's argument, no copy.
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    host_data = any(t.device.type == 'cpu' and t.dim() > 0 for t in tensors)
    if any(t.is_meta for t in tensors):
        return host_data or func in INDEXING and has_list(args[1])
    made_on_device = func in (torch.tensor, torch.Tensor.to) and getattr(result, 'is_meta', False)
    return made_on_device and not kwargs.get('non_blocking') and (host_data or func is torch.tensor)


INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


def has_list(index) -> bool:
    return isinstance(index, list) or isinstance(index, tuple) and any(isinstance(i, list) for i in index)


def first_read(module, cfg):
    # Where the loss first reads a value from the model's device: on 'meta', whose values cannot be read, each
    # such read (an .item(), a copy to the host, a tensor's truth, a masked_select's size) fails, as it would wait
    # for the GPU on a GPU, and so does each blocking copy to the device (BlockingCopiesFail). 'file:function', or
    # 'nowhere'.
    model, loss = loss_of(module, cfg, 'meta')
    outputs = model(torch.zeros(2, 3, 64, 64, device='meta'))
    try:
        with BlockingCopiesFail():
            loss(outputs, torch.tensor(TARGETS['apart']))
    except Exception as e:
        frame = [f for f in traceback.extract_tb(e.__traceback__)
                 if '/torch/' not in f.filename and f.name != '__torch_function__'][-1]
        return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}"
    return 'nowhere'


def cpu_numbers(module, cfg, targets):
    # the loss, its items and the gradients' bytes (exact), and the gradients' sum and sum of squares (to compare
    # with a tolerance)
    model, loss = loss_of(module, cfg, 'cpu')
    value, items = loss(model(torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))),
                        torch.tensor(targets).reshape(-1, 6))
    value.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return {'exact': [value.item(), items.tolist(), hashlib.sha256(grads.numpy().tobytes()).hexdigest()],
            'approx': [value.item(), *items.tolist(), grads.sum().item(), grads.square().sum().item()]}


cases, DENSE = json.loads(sys.argv[1]), sys.argv[2:] == ['dense']
print(json.dumps({'numbers': {f'{module} {name}': cpu_numbers(module, cfg, targets)
                              for module, cfg in cases for name, targets in TARGETS.items()},
                  'reads': {module: first_read(module, cfg) for module, cfg in cases}}))
"""
LOSS_CASES = [['utils.loss_tal', 'tiny.yaml'], ['utils.loss_tal_dual', 'tiny-dual.yaml'],
              ['utils.loss_tal_triple', 'tiny-triple.yaml']]


def losses(tree: Path, env: dict, *how) -> dict:
    """LOSSES_ON_META's findings for the three detection losses in tree (how: 'dense', the lever dense_box_loss)."""
    cases = json.dumps([[module, str(Path(TINY_CFG).with_name(cfg))] for module, cfg in LOSS_CASES])
    result = probe(tree, LOSSES_ON_META, env, args=[cases, *how])
    assert result.returncode == 0, describe(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


def exact(found: dict) -> dict:
    return {case: numbers['exact'] for case, numbers in found['numbers'].items()}


@pytest.fixture(scope='module')
def patched_losses(patched_tree, tmp_path_factory) -> dict:
    return losses(patched_tree, offline_environment(tmp_path_factory.mktemp('losses') / 'home'))


def first_reads(where: str) -> dict:
    return {module: where.format(file=module.split('.')[1]) for module, _ in LOSS_CASES}


@pytest.mark.slow
def test_0016_detection_losses_reach_their_assigner_without_waiting_for_the_gpu(tree_without, patched_losses,
                                                                                offline_env):
    # without 0016 the image size is a blocking copy, and so is its (w, h, w, h) by a list index; make_anchors'
    # torch.full(..., GPU stride) reads each stride, and preprocess() tests, indexes and slices by GPU counts for each
    # image: about 100 waits a step, each leaving the GPU idle. The first of them is the image size's copy.
    without = losses(tree_without(16), offline_env)
    assert without['reads'] == first_reads('{file}.py:__call__')
    # on the host both trees compute the same numbers, bit for bit: the loss, its items and the gradients
    assert exact(without) == exact(patched_losses)


@pytest.mark.slow
def test_0017_detection_losses_wait_for_the_gpu_only_in_their_box_losses_masked_select(tree_without, patched_losses,
                                                                                      offline_env):
    # without 0017 the assigner copies the GPU labels into a host index and tests fg_mask.max(), the loss compares its
    # divisor with 1 and tests fg_mask.sum() in Python: waits before the box loss, which 0017 runs whatever the
    # foreground
    without = losses(tree_without(17), offline_env)
    assert without['reads'] == first_reads('assigner.py:get_box_metrics')
    assert patched_losses['reads'] == first_reads('{file}.py:forward')  # BboxLoss's masked_select
    assert exact(without) == exact(patched_losses)  # with boxes apart, sharing anchors, and none


@pytest.mark.slow
def test_the_lever_dense_box_loss_leaves_the_detection_losses_no_wait_and_their_numbers(patched_tree,
                                                                                       patched_losses, offline_env):
    dense = losses(patched_tree, offline_env, 'dense')
    assert dense['reads'] == first_reads('nowhere')
    for case, numbers in patched_losses['numbers'].items():  # sums in another order: the last bits may differ
        assert dense['numbers'][case]['approx'] == pytest.approx(numbers['approx'], rel=1e-5, abs=1e-9), case


PADDING = """
import hashlib, json
from types import SimpleNamespace
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from utils import loss_tal, loss_tal_dual, loss_tal_triple


class Census(TorchDispatchMode):
    operators = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Census.operators += 1
        return func(*args, **(kwargs or {}))


def batch(images, g):  # 0 to 11 targets an image, in the loader's order
    counts = torch.randint(0, 12, (images,), generator=g)
    return torch.cat([torch.repeat_interleave(torch.arange(images), counts).float()[:, None],
                      torch.rand(int(counts.sum()), 5, generator=g)], 1)


g = torch.Generator().manual_seed(0)
digest, operators = hashlib.sha256(), {}
for loss in (loss_tal.ComputeLoss, loss_tal_dual.ComputeLoss, loss_tal_dual.ComputeLossLH,
             loss_tal_triple.ComputeLoss):
    for images in (16, 32):
        rows = batch(images, g)
        for targets in (rows, rows[torch.randperm(len(rows), generator=g)]):  # in order, shuffled
            Census.operators = 0
            with Census():
                padded = loss.preprocess(SimpleNamespace(device=torch.device('cpu')), targets, images, torch.ones(4))
            digest.update(padded.numpy().tobytes())
        operators[f'{loss.__module__}.{loss.__name__} {images}'] = Census.operators
print(json.dumps({'padded': digest.hexdigest(), 'operators': operators}))
"""


def padding(tree: Path, env: dict) -> dict:
    result = probe(tree, PADDING, env)
    assert result.returncode == 0, describe(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_0018_detection_losses_pad_a_batchs_targets_in_operators_as_many_whatever_its_images_with_the_same_numbers(
        tree_without, patched_tree, offline_env):
    # without 0018 preprocess() pads the targets one image at a time, about 9 operators an image the host dispatches
    # (and on a GPU three waits an image); 0018 pads the whole batch at once: the same padded targets, in the loader's
    # order or not
    without, patched = padding(tree_without(18), offline_env), padding(patched_tree, offline_env)
    assert patched['padded'] == without['padded']
    for loss in {case.rsplit(' ', 1)[0] for case in patched['operators']}:
        grown = [found['operators'][f'{loss} 32'] - found['operators'][f'{loss} 16'] for found in (without, patched)]
        assert grown[0] > 100 and grown[1] == 0, (loss, without, patched)  # 16 more images: ~140 more, or none


DENSE_BOX_LOSS_IN_HALF = """
import json, types
import torch
from utils.loss_tal_dual import BboxLoss
from yolov9_ddp import boxloss
# a box loss's inputs under a GPU's autocast, for a batch of 32 at 640 px: float16 predictions, float32 targets, 1% of
# the anchors foreground
g = torch.Generator().manual_seed(0)
anchors = torch.rand(8400, 2, generator=g) * 80
sides = torch.rand(32, 8400, 4, generator=g) * 15
pred_bboxes = torch.cat([anchors - sides[..., :2], anchors + sides[..., 2:]], -1).half().requires_grad_()
pred_dist = torch.randn(32, 8400, 64, generator=g).half().requires_grad_()
fg_mask = torch.rand(32, 8400, generator=g) < 0.01
target_bboxes = pred_bboxes.detach().float() + torch.rand(32, 8400, 4, generator=g)
target_scores = torch.rand(32, 8400, 5, generator=g) * fg_mask.unsqueeze(-1)


def numbers(dense):
    bbox_loss = BboxLoss(15, use_dfl=True)
    if dense:  # as the lever sets up a ComputeLoss, whose box losses are its attributes
        boxloss.weigh_every_anchor(types.SimpleNamespace(bbox_loss=bbox_loss))
    pred_bboxes.grad = pred_dist.grad = None
    loss_iou, loss_dfl, _ = bbox_loss(pred_dist, pred_bboxes, anchors, target_bboxes, target_scores,
                                      target_scores.sum().clamp(min=1), fg_mask)
    (loss_iou + loss_dfl).backward()
    return [loss_iou.item(), loss_dfl.item(), pred_bboxes.grad.float().square().sum().item(),
            pred_dist.grad.float().square().sum().item()]


print(json.dumps({'upstream': numbers(False), 'dense': numbers(True)}))
"""


@pytest.mark.slow
def test_the_lever_dense_box_loss_stays_finite_in_float16(patched_tree, offline_env):
    # the background's terms are weighted by zero, which keeps them out only while they are finite: a background
    # anchor's prediction against itself gives CIoU an infinite or NaN alpha in float16 (a NaN loss on a GPU)
    result = probe(patched_tree, DENSE_BOX_LOSS_IN_HALF, offline_env)
    assert result.returncode == 0, describe(result)
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(math.isfinite(x) for x in found['dense']), found
    assert found['dense'] == pytest.approx(found['upstream'], rel=1e-5), found
