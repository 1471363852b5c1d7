"""How ddp_train_dual.py fails: every case is a real launch with a deadline (torchrun with 2 processes where the
case is about DDP, else one process), which must end quickly with a non-zero exit, one error line from one
rank, no Python traceback from the workers, and no rank left waiting for a timeout. The option rules of
yolov9_ddp.cli.check_launch and check_options and the device checks of yolov9_ddp.comm.select_device are also
unit-tested.
"""
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from testsupport import zygote
from testsupport.faults import ERROR_LINE, FAULTY
from testsupport.jobs import free_port, job_env, run, torchrun_cmd, train_args
from testsupport.injected import Fault, to_env
from yolov9_ddp import cli, comm
from yolov9_ddp.tasks import TASKS

DUAL = TASKS['detect-dual']

pytestmark = pytest.mark.timeout(600)

DEADLINE_S = 120  # subprocess limit of a launch; a failing launch must end well before it
QUICK_S = 60  # "well under": and under --ddp-timeout, so a rank stuck in a collective cannot go unnoticed
DDP_TIMEOUT_S = 60  # passed to every launch: a stuck rank would report a timeout instead of lingering
TIMEOUT_SIGNS = ('collective operation failed or timed out', 'DistBackendError', 'DistNetworkError',
                 'Timed out', 'timed out')


@dataclass
class Launch:
    returncode: int
    wall_s: float
    outputs: dict  # rank -> that worker's stdout + stderr
    launcher_output: str  # torchrun's own console output ('' for a single process)

    def describe(self) -> str:
        text = [f'exit {self.returncode} after {self.wall_s:.1f} s', f'--- launcher\n{self.launcher_output[-3000:]}']
        text += [f'--- rank {rank}\n{out[-3000:]}' for rank, out in sorted(self.outputs.items())]
        return '\n'.join(text)


def launch(tree, nproc, args, folder: Path, script='ddp_train_dual.py', fault=()) -> Launch:
    """ddp_train_dual.py ARGS under torchrun (per-rank output files) for nproc > 1, else as one process; with a
    fault, the fault driver instead (testsupport/probes/faulty_train.py)."""
    args = [*map(str, args), '--ddp-timeout', str(DDP_TIMEOUT_S)]
    log_dir = folder / 'torchrun-logs'
    script = FAULTY if fault else script
    if nproc > 1:
        cmd = torchrun_cmd(nproc, script, *args,
                           launcher=('--nnodes', '1', '--log-dir', log_dir, '--redirects', '3'))
    else:
        cmd = [sys.executable, script, *args]
    start = time.monotonic()
    try:
        result = run(cmd, tree, DEADLINE_S, job_env(FAULT=to_env(fault)), stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f'the launch did not end within {DEADLINE_S} s: {cmd}\n{e.output[-3000:]}')
    wall = time.monotonic() - start
    if nproc == 1:
        return Launch(result.returncode, wall, {0: result.stdout}, '')
    outputs = {}
    for stderr in log_dir.rglob('stderr.log'):
        stdout = stderr.with_name('stdout.log')
        outputs[int(stderr.parent.name)] = (stdout.read_text() if stdout.is_file() else '') + stderr.read_text()
    return Launch(result.returncode, wall, outputs, result.stdout)


def assert_clean_failure(run: Launch, nproc, *fragments):
    """Non-zero exit, quickly; exactly one error line (from one rank) naming the problem; no traceback from our
    script on any rank; no sign of a collective that timed out."""
    assert run.returncode != 0, run.describe()
    assert sorted(run.outputs) == list(range(nproc)), run.describe()  # every rank ran (and wrote its output)
    assert run.wall_s < QUICK_S, f'took {run.wall_s:.0f} s\n{run.describe()}'
    combined = ''.join(run.outputs.values())
    assert combined.count(ERROR_LINE) == 1, f'expected one error line across ranks\n{run.describe()}'
    line = combined[combined.index(ERROR_LINE):]
    for fragment in fragments:
        assert fragment in line, f'{fragment!r} not in the error message\n{run.describe()}'
    for rank, out in run.outputs.items():
        assert 'Traceback' not in out, f'a traceback on rank {rank}\n{run.describe()}'
    assert 'ddp_train_dual.py", line' not in run.launcher_output, run.describe()  # no frame of ours anywhere
    for sign in TIMEOUT_SIGNS:
        assert sign not in combined + run.launcher_output, f'{sign!r}: a rank timed out\n{run.describe()}'
    return line


def launch_ranks_directly(tree, nproc, args, folder: Path) -> list:
    """The ranks of a one-node job started as separate processes with torchrun's environment (env://
    rendezvous), so that each one's own exit is seen: under torchrun, the first rank to fail makes torchrun
    terminate the others, which would hide a rank that never exits by itself. Returns [(exit, seconds, output)]."""
    port = free_port()
    args = [*map(str, args), '--ddp-timeout', str(DDP_TIMEOUT_S)]
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(nproc):
        log = open(folder / f'rank{rank}.log', 'w+')
        env = job_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc, GROUP_RANK=0,
                      MASTER_ADDR='127.0.0.1', MASTER_PORT=port)
        procs.append(zygote.popen([sys.executable, 'ddp_train_dual.py', *args], tree, env, job_env(), log,
                                  subprocess.STDOUT))
        logs.append(log)
    results = []
    try:
        for proc, log in zip(procs, logs):
            remaining = max(DEADLINE_S - (time.monotonic() - start), 1)
            try:
                code = proc.wait(remaining)
            except subprocess.TimeoutExpired:
                code = None
            log.seek(0)
            results.append((code, time.monotonic() - start, log.read()))
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return results


def assert_every_rank_exits_by_itself(results, *fragments):
    describe = '\n'.join(f'--- rank {r}: exit {code} after {t:.1f} s\n{out[-2000:]}'
                         for r, (code, t, out) in enumerate(results))
    for rank, (code, seconds, out) in enumerate(results):
        assert code is not None, f'rank {rank} did not exit within {DEADLINE_S} s\n{describe}'
        assert code in (1, 2), f'rank {rank} exited with {code}\n{describe}'  # its own exit, not a signal
        assert seconds < QUICK_S, describe
        assert 'Traceback' not in out, describe
    combined = ''.join(out for _, _, out in results)
    assert combined.count(ERROR_LINE) == 1, describe
    for fragment in fragments:
        assert fragment in combined, describe


# -- datasets that cannot be used -----------------------------------------------------------------------------------

def demo_root(demo_data: Path) -> Path:
    return demo_data.parent


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def base(demo_data, tiny_cfg, tmp_path):
    """train_args of a 1-epoch run (batch 4, 64 px, CPU) on the demo data or the given data yaml."""
    def make(data=demo_data, batch=4):
        return list(map(str, train_args(data, tmp_path / 'runs', 1, batch, 64)))
    return make


@pytest.fixture(scope='module')
def wrong_class_data(demo_data, tmp_path_factory):
    """The demo images with a class-7 box in every label file, and a 3-class data yaml."""
    root = tmp_path_factory.mktemp('class7')
    for split in ('train', 'val'):
        shutil.copytree(demo_root(demo_data) / 'images' / split, root / 'images' / split)
        labels = root / 'labels' / split
        labels.mkdir(parents=True)
        for image in (root / 'images' / split).glob('*.jpg'):
            (labels / f'{image.stem}.txt').write_text('7 0.5 0.5 0.2 0.2\n1 0.3 0.3 0.1 0.1\n')
    return write_yaml(root / 'data.yaml', f'path: {root}\ntrain: images/train\nval: images/val\n'
                                          'names:\n  0: a\n  1: b\n  2: c\n')


# -- option errors -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_batch_size_not_divisible_by_world_size(patched_tree, base, tmp_path):
    run = launch(patched_tree, 2, base(batch=5), tmp_path)
    assert_clean_failure(run, 2, '--batch-size 5', '2 processes')


@pytest.mark.slow
def test_a_flag_argparse_cannot_read_is_one_line_not_a_usage_block_from_every_rank(patched_tree, base, tmp_path):
    run = launch(patched_tree, 2, base() + ['--bogus'], tmp_path)
    assert_clean_failure(run, 2, 'unrecognized arguments: --bogus', '--help lists the flags')
    assert 'usage:' not in ''.join(run.outputs.values()), run.describe()


@pytest.mark.slow
def test_image_weights_under_ddp(patched_tree, base, tmp_path):
    run = launch(patched_tree, 2, base() + ['--image-weights'], tmp_path)
    assert_clean_failure(run, 2, '--image-weights', 'DDP')


@pytest.mark.slow
@pytest.mark.parametrize('nproc', [1, 2])
def test_evolve_is_refused(patched_tree, base, tmp_path, nproc):
    run = launch(patched_tree, nproc, base() + ['--evolve'], tmp_path)
    assert_clean_failure(run, nproc, '--evolve', 'train_dual.py')
    assert not (tmp_path / 'runs').exists()  # refused before anything was created


@pytest.mark.slow
def test_the_line_of_an_error_every_rank_sees_is_out_before_torchrun_stops_rank_0(patched_tree, base, tmp_path):
    """Rank 0 alone prints an error every rank sees alike (here --evolve); the other ranks exit only once its line
    is out, since torchrun stops every rank as soon as one exits. Here rank 0 takes 3 s to print it: a rank 1 that
    exited at once would have had rank 0 stopped first, and the job would end without its line."""
    run = launch(patched_tree, 2, base() + ['--evolve'], tmp_path, fault=Fault('slow', rank=0, where='report', sleep=3))
    assert_clean_failure(run, 2, '--evolve', 'train_dual.py')


@pytest.mark.slow
def test_autobatch_under_ddp(patched_tree, base, tmp_path):
    run = launch(patched_tree, 2, base(batch=-1), tmp_path)
    assert_clean_failure(run, 2, 'AutoBatch', '--batch-size -1')


@pytest.mark.slow
def test_missing_data_yaml(patched_tree, base, tmp_path):
    missing = tmp_path / 'nowhere' / 'data.yaml'
    run = launch(patched_tree, 2, base(missing), tmp_path)
    assert_clean_failure(run, 2, f'--data {missing}', 'no such file')


@pytest.mark.slow
def test_malformed_data_yaml(patched_tree, base, tmp_path):
    bad = write_yaml(tmp_path / 'bad.yaml', 'train: [images/train\nval: images/val\nnames: {0: a\n')
    run = launch(patched_tree, 2, base(bad), tmp_path)
    assert_clean_failure(run, 2, f'--data {bad}')


@pytest.mark.slow
def test_data_yaml_without_val(patched_tree, base, demo_data, tmp_path):
    data = write_yaml(tmp_path / 'noval.yaml', f'path: {demo_root(demo_data)}\ntrain: images/train\n'
                                               'names:\n  0: a\n  1: b\n  2: c\n')
    run = launch(patched_tree, 2, base(data), tmp_path)
    assert_clean_failure(run, 2, f'--data {data}', "'val:'", 'missing')


@pytest.mark.slow
def test_data_yaml_whose_train_folder_has_no_images(patched_tree, base, demo_data, tmp_path):
    empty = tmp_path / 'empty' / 'images' / 'train'
    empty.mkdir(parents=True)
    (empty / 'notes.txt').write_text('no images here\n')
    data = write_yaml(tmp_path / 'empty.yaml', f'train: {empty}\nval: {demo_root(demo_data) / "images" / "val"}\n'
                                               'names:\n  0: a\n  1: b\n  2: c\n')
    run = launch(patched_tree, 2, base(data), tmp_path)
    assert_clean_failure(run, 2, str(empty), 'No images found')


def test_cuda_device_without_cuda(patched_tree, base, tmp_path):
    args = base()
    args[args.index('--device') + 1] = '0'
    run = launch(patched_tree, 1, args, tmp_path)
    assert_clean_failure(run, 1, '--device 0', 'cannot use CUDA here', 'use --device cpu')


@pytest.mark.slow
def test_labels_with_a_class_beyond_nc(patched_tree, base, wrong_class_data, tmp_path):
    run = launch(patched_tree, 2, base(wrong_class_data), tmp_path)
    assert_clean_failure(run, 2, 'label class 7', 'nc=3')


@pytest.mark.slow
def test_resume_from_a_path_that_does_not_exist(patched_tree, base, tmp_path):
    missing = tmp_path / 'old' / 'exp' / 'weights' / 'last.pt'
    run = launch(patched_tree, 2, base() + ['--resume', missing], tmp_path)
    assert_clean_failure(run, 2, '--resume', str(missing))
    assert not (tmp_path / 'runs').exists()


# -- every rank exits by itself -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_every_rank_exits_by_itself_on_labels_beyond_nc(patched_tree, base, wrong_class_data, tmp_path):
    results = launch_ranks_directly(patched_tree, 2, base(wrong_class_data), tmp_path)
    assert_every_rank_exits_by_itself(results, 'label class 7', 'nc=3')


def test_every_rank_exits_by_itself_when_rank_0_fails_alone(patched_tree, base, tmp_path):
    # the data yaml is read by rank 0 first (comm.run_staged): the other ranks learn of its failure and stop
    bad = write_yaml(tmp_path / 'bad.yaml', 'train: [images/train\nval: images/val\n')
    results = launch_ranks_directly(patched_tree, 2, base(bad), tmp_path)
    assert_every_rank_exits_by_itself(results, f'--data {bad}')


# -- unit tests: option rules --------------------------------------------------------------------------------------

@pytest.fixture
def options(tmp_path):
    """Parsed options of a valid command line (existing data and hyp files), to be altered by each test."""
    (tmp_path / 'data' / 'hyps').mkdir(parents=True)
    (tmp_path / 'data' / 'hyps' / 'hyp.scratch-high.yaml').write_text('lr0: 0.01\n')
    (tmp_path / 'data.yaml').write_text('train: x\nval: x\n')
    (tmp_path / 'w.pt').write_bytes(b'')

    def make(*args):
        return cli.parse_args(['--data', str(tmp_path / 'data.yaml'), *map(str, args)], tmp_path, DUAL)
    return make


def refused(opt, world) -> str:
    with pytest.raises(cli.UsageError) as e:
        cli.check_options(opt, world, DUAL)
    return str(e.value)


@pytest.mark.parametrize('world', [1, 2, 8])
def test_check_options_accepts_a_valid_command_line(options, world, tmp_path):
    cli.check_options(options('--batch-size', 16, '--weights', tmp_path / 'w.pt'), world, DUAL)


def test_check_options_evolve_at_any_world_size(options):
    for world in (1, 2):
        assert '--evolve' in refused(options('--evolve'), world)
        assert '--evolve' in refused(options('--evolve', 5), world)


def test_check_options_image_weights_only_on_one_process(options):
    cli.check_options(options('--image-weights'), 1, DUAL)
    assert '--image-weights' in refused(options('--image-weights'), 2)


def test_check_options_autobatch_only_on_one_process(options):
    cli.check_options(options('--batch-size', -1), 1, DUAL)
    assert 'AutoBatch' in refused(options('--batch-size', -1), 2)


def test_check_options_quad_needs_four_images_a_process(options):
    cli.check_options(options('--quad', '--batch-size', 8), 2, DUAL)
    cli.check_options(options('--quad', '--batch-size', -1), 1, DUAL)  # AutoBatch's batch is 16 or more
    assert refused(options('--quad', '--batch-size', 6), 2) == (
        '--quad makes one image of each 4 a process loads: --batch-size 6 on 2 process(es) gives each fewer; use 8 '
        'or more')


def test_check_options_batch_divisible_by_world_size(options):
    cli.check_options(options('--batch-size', 5), 1, DUAL)
    cli.check_options(options('--batch-size', 6), 3, DUAL)
    message = refused(options('--batch-size', 5), 2)
    assert '--batch-size 5' in message and '2' in message
    assert '--batch-size 8' in refused(options('--batch-size', 8), 3)


@pytest.mark.parametrize('batch', [0, -2])
def test_check_options_rejects_batch_sizes_that_are_none(options, batch):
    assert f'--batch-size {batch}' in refused(options('--batch-size', batch), 1)


def test_check_options_at_least_one_epoch(options):
    cli.check_options(options('--epochs', 1), 1, DUAL)
    assert '--epochs 0' in refused(options('--epochs', 0), 1)


def refused_launch(opt) -> str:
    with pytest.raises(cli.UsageError) as e:
        cli.check_launch(opt)
    return str(e.value)


def test_a_value_argparse_cannot_read_is_a_usage_error(options):
    with pytest.raises(cli.UsageError, match=r"argument --epochs: invalid int value: 'x' \(--help lists the flags\)"):
        options('--epochs', 'x')


@pytest.mark.parametrize('timeout', [0, -5])
def test_check_launch_positive_ddp_timeout(options, timeout):
    assert '--ddp-timeout' in refused_launch(options('--ddp-timeout', timeout))


def test_checkpoint_intervals_are_off_by_default_and_parse_as_counts_and_minutes(options):
    assert (options().checkpoint_steps, options().checkpoint_minutes) == (0, 0)
    opt = options('--checkpoint-steps', 500, '--checkpoint-minutes', 2.5)
    assert (opt.checkpoint_steps, opt.checkpoint_minutes) == (500, 2.5)
    cli.check_launch(opt)


@pytest.mark.parametrize('flag, value', [('--checkpoint-steps', '-1'), ('--checkpoint-minutes', '-0.5'),
                                         ('--checkpoint-minutes', 'nan')])
def test_check_launch_refuses_negative_checkpoint_intervals(options, flag, value):
    assert refused_launch(options(flag, value)).startswith(f'{flag} {value}: give a number of ')


def test_check_launch_resume_or_auto_resume_not_both(options):
    cli.check_launch(options('--auto-resume'))
    assert '--auto-resume' in refused_launch(options('--resume', '--auto-resume'))


@pytest.mark.parametrize('flag', ['data', 'hyp', 'weights'])
def test_check_options_named_files_must_exist(options, tmp_path, flag):
    missing = tmp_path / f'missing-{flag}'
    message = refused(options(f'--{flag}', missing), 1)
    assert f'--{flag} {missing}' in message and 'no such file' in message
    cli.check_options(options(f'--{flag}', missing, '--resume'), 1, DUAL)  # on resume the run's own options count
    cli.check_options(options(f'--{flag}', f'https://example.com/{flag}.yaml'), 1, DUAL)  # downloaded later


def test_check_options_without_data_uses_the_demo_dataset(tmp_path):
    (tmp_path / 'data' / 'hyps').mkdir(parents=True)
    (tmp_path / 'data' / 'hyps' / 'hyp.scratch-high.yaml').write_text('lr0: 0.01\n')
    opt = cli.parse_args([], tmp_path, DUAL)
    cli.check_options(opt, 2, DUAL)
    assert cli.uses_demo(opt)


# -- unit tests: devices --------------------------------------------------------------------------------------------

@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `count` CUDA devices and torchrun started `local_world` processes here."""
    def set_up(count, local_world, local_rank):
        monkeypatch.setattr(torch.cuda, 'is_available', lambda: count > 0)
        monkeypatch.setattr(torch.cuda, 'device_count', lambda: count)
        monkeypatch.setenv('LOCAL_WORLD_SIZE', str(local_world))
        monkeypatch.setenv('LOCAL_RANK', str(local_rank))
        monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '')  # select_device may set it: monkeypatch restores it
    return set_up


@pytest.mark.parametrize('device', ['', '0,1'])
def test_more_processes_than_gpus_is_a_launch_error(gpus, device):
    gpus(2, 4, 3)
    with pytest.raises(comm.LaunchError) as e:
        comm.select_device(device)
    message = str(e.value)
    assert re.search(r'\b4 processes\b', message) and re.search(r'\b2 CUDA device', message), message


def test_each_process_gets_the_gpu_of_its_local_rank(gpus):
    gpus(2, 2, 1)
    assert comm.select_device('') == torch.device('cuda', 1)
    assert comm.select_device('cpu') == torch.device('cpu')


def test_cuda_device_on_a_machine_without_cuda_is_a_launch_error(gpus):
    gpus(0, 1, 0)
    with pytest.raises(comm.LaunchError, match='--device 0'):
        comm.select_device('0')
    assert comm.select_device('') == torch.device('cpu')  # no --device: the CPU, as upstream
