"""bench/: the targets are medians of alternating pairs (bench/results.py), a dry run never lands among the GPU
figures, and a call of the harness (bench/run_bench.py) runs end to end on CPUs and records every target key."""
import gc
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench import results, run_bench
from testsupport.trees import KIT, cache_dir, describe
from yolov9_ddp.tasks import TASKS

REQUIRED = ['per_gpu_vs_upstream_2gpu', 'scaling_2gpu', 'val_2gpu_vs_rank0', 'parity_map50_95_points',
            'ram_cache_2ranks_vs_1rank']  # the N-GPU keys, N = 2


def series(*ratios) -> dict:
    return results.summarise({'pairs': [{'a': {}, 'b': {}, 'ratio': r} for r in ratios]})


def test_the_target_keys_are_named_for_2_gpus_and_follow_the_gpu_count():
    assert results.target_keys(2) == REQUIRED
    assert 'scaling_4gpu' in results.target_keys(4) and 'ram_cache_4ranks_vs_1rank' in results.target_keys(4)


def test_a_target_is_the_median_of_its_pairs_and_parity_the_larger_of_its_two():
    pairs = {'scaling_2gpu': series(1.9, 2.0, 1.5), 'parity_map50_95_points/gpus': series(0.1, 0.3, 0.2),
             'parity_map50_95_points/numerics': series(0.4, 0.6, 0.5, None)}
    targets = results.targets_from(pairs, 2)
    assert list(targets) == REQUIRED
    assert targets['scaling_2gpu'] == 1.9 and targets['parity_map50_95_points'] == 0.5
    assert targets['per_gpu_vs_upstream_2gpu'] is None
    assert pairs['scaling_2gpu']['complete'] and pairs['scaling_2gpu']['spread'] == [1.5, 2.0]
    assert not series(1.0, None, 2.0)['complete'], 'a failed pair does not count'


def call(mode, **pairs) -> dict:
    return {'mode': mode, 'gpus': 2, 'machine': {}, 'calls': [{'call': 'x'}], 'pairs': pairs}


def test_a_dry_run_never_lands_among_the_gpu_figures():
    merged = results.merge(call('gpu', scaling_2gpu=series(1.9, 1.95, 2.0)), {})
    merged = results.merge(call('dry-run (CPU, gloo)', scaling_2gpu=series(0.5, 0.5, 0.5)), merged)
    assert merged['targets']['scaling_2gpu'] == 1.95 and merged['pairs']['scaling_2gpu']['median'] == 1.95
    assert merged['dry_run']['targets']['scaling_2gpu'] == 0.5 and 'measure nothing' in merged['dry_run']['note']


def test_the_one_gpu_targets_land_beside_the_n_gpu_ones():
    merged = results.merge(call('gpu', deterministic_vs_upstream_1gpu=series(0.9, 1.0, 1.1)), {})
    assert list(merged['targets']) == REQUIRED + list(results.ONE_GPU_TARGETS)
    assert merged['targets']['deterministic_vs_upstream_1gpu'] == 1.0
    assert merged['targets']['checkpoint_minutes_1_vs_none_1gpu'] is None


def test_a_series_of_the_kit_with_other_levers_than_its_defaults_never_stands_for_a_target():
    chosen, suffix = run_bench.kit_levers('cuda_graphs=1,channels_last=1')
    assert chosen == ['--levers', 'cuda_graphs=1,channels_last=1'] and run_bench.kit_levers('') == ([], '')
    merged = results.merge(call('gpu', **{f'per_gpu_vs_upstream_1gpu{suffix}': series(2.0, 2.1, 2.2),
                                          f'{results.PARITY}{suffix}/numerics': series(0.1, 0.2, 0.3)}), {})
    assert merged['targets']['per_gpu_vs_upstream_1gpu'] is None and merged['targets'][results.PARITY] is None
    assert merged['pairs'][f'per_gpu_vs_upstream_1gpu{suffix}']['median'] == 2.1


def test_per_gpu_of_another_detection_task_compares_its_upstream_script_with_its_entry_point_under_its_own_key():
    bench = run_bench.Bench.__new__(run_bench.Bench)  # no trees or datasets: the commands alone
    bench.size, bench.cuda, bench.work = run_bench.SIZES['gpu'], True, KIT / 'work'
    bench.upstream, bench.kit = KIT / 'up', KIT / 'kit'

    def commands(task_name):
        bench.args = SimpleNamespace(task=task_name)
        task, suffix = bench.task()
        made = [bench.train_cmd(tree, 1, 'data.yaml', 'run', task=task)  # the task's model unless told another
                for tree in (bench.upstream, bench.kit)]
        return suffix, [(cmd[1], cmd[cmd.index('--cfg') + 1]) for cmd in made]
    assert commands('detect') == (' (detect)', [('train.py', 'models/detect/gelan-s.yaml'),
                                                ('ddp_train.py', 'models/detect/gelan-s.yaml')])
    assert commands('detect-triple')[1] == [('train_triple.py', 'models/detect/yolov9-cf.yaml'),
                                            ('ddp_train_triple.py', 'models/detect/yolov9-cf.yaml')]
    assert commands('detect-dual') == ('', [('train_dual.py', 'models/detect/yolov9-s.yaml'),
                                           ('ddp_train_dual.py', 'models/detect/yolov9-s.yaml')]), "the targets' own"
    what = run_bench.of_script(results.TARGETS['per_gpu_vs_upstream_{n}gpu'], TASKS['detect'])
    assert 'upstream train.py' in what and 'train_dual' not in what
    merged = results.merge(call('gpu', **{'per_gpu_vs_upstream_1gpu (detect)': series(2.0, 2.1, 2.2)}), {})
    assert merged['targets']['per_gpu_vs_upstream_1gpu'] is None, 'train_dual.py stands for the target alone'


def stub_bench(tmp_path, call: str, pairs: int):
    """A Bench of the GPU sizes on one GPU, without its trees or machine: a test stands in for its runs."""
    bench = run_bench.Bench.__new__(run_bench.Bench)
    bench.size, bench.cuda, bench.work, bench.upstream, bench.kit = run_bench.SIZES['gpu'], True, tmp_path, 'up', 'kit'
    bench.args, bench.started, bench.deadline = SimpleNamespace(call=call, pairs=pairs), 0, 1e9
    bench.record, bench.call, bench.out, bench.n = {'pairs': {}}, {}, tmp_path, 1
    bench.dataset = lambda name: f'{name}.yaml'
    return bench


def test_a_short_job_pairs_whole_runs_by_their_seconds_first_epoch_peak_memory_and_the_kits_epoch_end(tmp_path):
    """short-job's series from made-up runs (Bench.train stood in for): upstream's seconds over the kit's, the kit's
    memory over upstream's, and the kit's own epoch end beyond validation, each run to its end."""
    bench = stub_bench(tmp_path, 'short-job', pairs=3)
    runs = {'up': dict(seconds=60, first_epoch_end_s=20, peak_mem_mib={0: 10000}),
            'kit': dict(seconds=30, first_epoch_end_s=25, peak_mem_mib={0: 11000}, epoch_end_beyond_validation_s=0.05)}
    asked = []

    def train(name, cmd, tree, images, rows=2, to_the_end=False):
        asked.append((tree, cmd[cmd.index('--epochs') + 1], cmd[cmd.index('--batch-size') + 1], rows, to_the_end))
        return runs[tree]
    bench.train = train
    run_bench.Bench.short_job(bench)
    assert asked == [('up', '6', '16', 1, True), ('kit', '6', '16', 1, True)] * 3
    medians = {key: series['median'] for key, series in bench.record['pairs'].items()}
    assert medians == {'short_job_vs_upstream_1gpu': 2.0, 'first_epoch_vs_upstream_1gpu': 0.8,
                       'peak_memory_vs_upstream_b16_1gpu': 1.1, 'epoch_end_beyond_validation_s_1gpu': 0.05}
    assert set(medians) <= set(results.ONE_GPU_TARGETS)


def test_fits_runs_each_pair_with_upstreams_own_peak_and_15_percent_free_and_counts_the_kits_completions(
        tmp_path, monkeypatch):
    """fits from made-up runs (Bench.train and the ballast stood in for): upstream alone first gives the memory to
    leave free; a kit run that fails is a 0, a pair where upstream failed has no figure."""
    bench = stub_bench(tmp_path, 'fits', pairs=3)
    left_free, runs = [], []

    class Ballast:
        def __init__(self, leave_mib):
            self.mib = 0
            left_free.append(leave_mib)

        def __enter__(self):
            return self

        def __exit__(self, *_):
            pass

    def train(name, cmd, tree, images, rows=2, to_the_end=False):
        runs.append((name, cmd[cmd.index('--epochs') + 1], cmd[cmd.index('--batch-size') + 1], to_the_end))
        if name in ('kit-fits-1', 'upstream-fits-2'):
            raise run_bench.RunFailed(f'{name} exited with 1 after 0 epochs: out of GPU memory')
        return dict(seconds=30, peak_mem_mib={0: 10000})
    monkeypatch.setattr(run_bench, 'Ballast', Ballast)
    bench.train = train
    run_bench.Bench.fits(bench)
    assert [name for name, *_ in runs] == ['upstream-alone-fits-0'] + [f'{side}-fits-{i}' for i in range(3)
                                                                      for side in ('upstream', 'kit')]
    assert {tuple(rest) for _, *rest in runs} == {('2', '32', True)}
    assert left_free == [None] + [11500] * 6
    series = bench.record['pairs']['fits_where_upstream_fits_1gpu']
    assert [pair['ratio'] for pair in series['pairs']] == [1, 0, None]
    assert 'out of GPU memory' in series['pairs'][1]['b']['failure']


def test_shared_node_counts_the_epochs_of_runs_started_at_once_with_one_command_and_fails_a_side_whose_run_died(
        tmp_path, monkeypatch):
    """shared-node from made-up runs (their launch, rows and stop stood in for): each side's runs start together with
    the same command but the seed, and its figure is their epochs summed; a run that exited leaves the pair empty."""
    bench = stub_bench(tmp_path, 'shared-node', pairs=2)
    launched, stopped = [], []
    rows = {'up': 6, 'kit': 9}

    def launch(name, cmd, tree):
        launched.append((name, cmd))
        died = name == 'kit-shared-1-2'
        return SimpleNamespace(poll=lambda: 1 if died else None, returncode=1, tree=tree), tmp_path / 'log'
    (tmp_path / 'log').write_text('out of memory\n')
    bench.launch = launch
    monkeypatch.setattr(run_bench, 'count_rows', lambda path: rows['kit' if 'kit-' in str(path) else 'up'])
    monkeypatch.setattr(run_bench, 'stop', lambda proc, cuda: stopped.append(proc.tree))
    monkeypatch.setattr(run_bench.time, 'sleep', lambda seconds: None)
    run_bench.Bench.shared_node(bench)
    assert [name for name, _ in launched[:8]] == [f'{side}-shared-0-{k}' for side in ('upstream', 'kit')
                                                  for k in range(4)]
    options = lambda cmd, flag: cmd[cmd.index(flag) + 1]
    assert {(options(cmd, '--workers'), options(cmd, '--imgsz'), options(cmd, '--batch-size'))
            for _, cmd in launched} == {('8', '320', '16')}
    assert [options(cmd, '--seed') for _, cmd in launched[:4]] == ['0', '1', '2', '3']
    series = bench.record['pairs']['shared_node_epochs_vs_upstream']
    assert series['pairs'][0]['a']['epochs'] == 24 and series['pairs'][0]['b']['epochs'] == 36
    assert [pair['ratio'] for pair in series['pairs']] == [1.5, None]
    assert 'out of memory' in series['pairs'][1]['b']['error']
    assert stopped == ['up'] * 4 + ['kit'] * 4 + ['up'] * 4 + ['kit'] * 4, 'every run stopped, a failed side too'


def test_an_option_the_call_does_not_read_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    def main(*argv):
        monkeypatch.setattr(sys, 'argv', ['run_bench.py', *argv, '--out', str(tmp_path)])
        with pytest.raises(SystemExit) as stopped:
            run_bench.main()
        return stopped.value.code, capsys.readouterr().err.splitlines()[-1]
    assert main('per-gpu', '--lever', 'cuda_graphs=1') == (
        2, 'run_bench.py: error: --lever: the per-gpu call does not read it (only loop-lever)')
    assert main('loop-lever', '--window-s', '30')[1].endswith('(only ckpt-windows)')
    assert "unrecognized arguments: --checkpoint-minutes" in main('loop-lever', '--checkpoint-minutes', '1')[1]
    assert main('per-gpu', '--quick')[1].endswith('(only entry-points)')
    assert 'does not read it' in main('loop-lever', '--kit-levers', 'channels_last=1')[1]
    assert main('ckpt-windows', '--task', 'detect')[1].endswith('(only per-gpu, per-gpu-det)')
    assert "invalid choice: 'segment'" in main('per-gpu', '--task', 'segment')[1], 'its photographs have no polygons'
    assert "invalid choice: 'lever'" in main('lever')[1]
    tags = [run_bench.lever_tag(lever) for lever in ('channels_last=1', 'cuda_graphs=0,channels_last=0')]
    assert tags == ['channels_last-1', 'cuda_graphs-0,channels_last-0']
    given = run_bench.argparse.Namespace(call='loop-lever', kit_levers='', lever=None, quick=False, window_s=None,
                                         task=None)
    run_bench.refuse_unread_options(None, given)
    assert (given.lever, given.window_s, given.task) == (None, 60, 'detect-dual'), 'the defaults'


def test_checkpoint_windows_pair_the_seconds_around_each_checkpoint_with_the_seconds_on_either_side():
    """bench/ckpt_windows.py's arithmetic on a made-up run: a batch a second, a stamp every 2, each checkpoint (at
    batches 20 and 40) stalling the run 2 s; windows of 10 s, the window without a checkpoint 5 s before and 5 s
    after it. Then a run whose pace rises steadily and that has no stall: its pairs are even, where a window without
    taken after the checkpoint only would have come out faster."""
    from bench.ckpt_windows import Enough, NotWritten, TooShort, Windows
    now = [0]
    windows = Windows(window_s=10, pairs=2, every=2, cuda=False, clock=lambda: now[0])
    with pytest.raises(Enough):
        for i in range(100):
            now[0] = i + 2 * (i > 20) + 2 * (i > 40)
            if i in (20, 40):
                windows.checkpoints.append(now[0])  # as the Trainer's save_periodic, before the step's stamp
            windows.stamp(0, i)
    assert i == 48 and now[0] >= 42 + 10, 'the run stops once the second pair\'s window without has passed'
    windows.parts = [{'write_s': 1.5}, {'write_s': 2.5}]
    with pytest.raises(NotWritten, match='checkpoint 1, 2 of the windows was not written'):
        windows.pairs_of(batch=4)
    windows.parts = [{'write_s': 1.5, 'written_s': 1.5}, {'write_s': 2.5, 'written_s': 2.5}]
    windows.collections = [(19, 0.25), (24, 0.5), (29, 0.125), (11, 1.0)]  # two in [15, 25), the window with;
    # one in each half of the window without
    with_one, without = {'img_per_s': 3.0, 'seconds': 8, 'batches': 6}, {'img_per_s': 4.0, 'seconds': 6, 'batches': 6}
    pairs = windows.pairs_of(batch=4)
    assert [{key: pair[key] for key in ('checkpoint_at_s', 'without', 'with')} for pair in pairs] == [
        {'checkpoint_at_s': 20, 'without': without, 'with': with_one},
        {'checkpoint_at_s': 42, 'without': without, 'with': with_one}]
    first = pairs[0]['checkpoint']
    assert first['write_s'] == 1.5 and pairs[1]['checkpoint']['write_s'] == 2.5
    assert first['lost_s'] == pairs[1]['checkpoint']['lost_s'] == 2, 'each stalled the run 2 s'
    assert first['timeline'][:5] == [[-4, 4.0], [-2, 4.0], [0, 4.0], [4, 2.0], [6, 4.0]]  # the stall after it
    assert first['timeline'][-1][0] < 20 and (first['gc_s_with'], first['gc_s_without']) == (0.75, 1.125)
    with pytest.raises(TooShort):
        windows.stamp(1, 0)
    windows.stamps = windows.stamps[::8]  # a stamp every 16 s: a window of 10 s holds one at most
    with pytest.raises(TooShort, match=r'5 s of a window held 0 stamp\(s\)'):
        windows.pairs_of(batch=4)

    rising = Windows(window_s=20, pairs=1, every=1, cuda=False, clock=lambda: now[0])
    now[0], pace = 0.0, 1.0
    with pytest.raises(Enough):
        for i in range(1000):  # each batch 0.2% faster than the one before
            now[0], pace = now[0] + pace, pace / 1.002
            if i == 40:
                rising.checkpoints.append(now[0])
            rising.stamp(0, i)
    rising.parts = [{'written_s': 0.1}]
    [pair] = rising.pairs_of(batch=100)  # img/s of hundreds: their rounding to 0.01 stays out of the ratio
    assert pair['with']['img_per_s'] / pair['without']['img_per_s'] == pytest.approx(1, abs=0.002)
    after_only = rising.rate(100, (rising.checkpoints[0] + 10, rising.checkpoints[0] + 20))  # as far as it ran
    assert pair['with']['img_per_s'] / after_only['img_per_s'] < 0.97, 'the drift this pairing cancels'


def test_checkpoint_windows_time_each_checkpoint_until_its_file_is_in_place(tmp_path):
    """bench/ckpt_windows.py's instruments on a real Checkpoints with its writer process: each periodic checkpoint is
    timed until its file is in place; an epoch's is none of the windows'."""
    from bench.ckpt_windows import Windows, instrument
    from yolov9_ddp.checkpoints import Checkpoints
    from yolov9_ddp.writer import WriterProcess
    model, last = torch.nn.Linear(1024, 1024), tmp_path / 'last.pt'  # a host copy that takes a millisecond or more
    callbacks = list(gc.callbacks)
    checkpoints = Checkpoints(print, WriterProcess(print))
    try:
        windows = Windows(window_s=10, pairs=1, every=1, cuda=False)
        instrument(checkpoints, windows)
        for epoch in (7, 8):
            checkpoints.save(lambda: {'epoch': epoch, 'model': model, 'ema': model, 'scaler': {}}, last,
                             'checkpoint', skip_if_busy=True)
            checkpoints.wait()
            part = windows.parts[-1]
            assert 0 < part['written_s'] <= part['write_s'] and part['training_thread_s'] > 0
            assert torch.load(last, weights_only=False)['epoch'] == epoch
        checkpoints.save(lambda: {'epoch': 9, 'model': model, 'ema': model, 'scaler': {}}, last, 'epoch end')
    finally:
        checkpoints.close()
        gc.callbacks[:] = callbacks
    assert len(windows.parts) == len(windows.checkpoints) == 2, 'the epoch\'s checkpoint is none of the windows\''


def test_the_gpu_sampler_reports_peak_memory_per_gpu_and_gpu_0s_clock_power_and_heat_over_a_span():
    """run_bench.GpuSampler on lines as nvidia-smi prints them (a stand-in prints them), GPU 0's at times 1, 2 and 3."""
    lines = ['0, 100, 1980, 650.5, 60', '1, 900, 1500, 300.0, 50', '0, 300, 1700, 690.0, 71', '0, 200, [N/A], 1, 1',
             '0, 150, 1800, 700.1, 65']
    times = iter(range(1, 100))
    sampler = run_bench.GpuSampler(['printf', '%s\\n', *lines], clock=lambda: next(times))
    sampler.thread.join(timeout=10)
    assert sampler.stop() == {0: 300, 1: 900}, 'a line with a field not reported is left out'
    assert sampler.during(1, 2) == {'sm_mhz': 1840.0, 'power_w': 670, 'temp_c_max': 71.0, 'samples': 2}
    assert sampler.during(3, 3) == {'sm_mhz': 1800.0, 'power_w': 700, 'temp_c_max': 65.0, 'samples': 1}
    assert sampler.during(4, 9) == {}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_dry_run_call_runs_end_to_end_and_records_every_target_key(pinned_upstream, tmp_path, offline_env):
    """val-cache on 2 CPU processes, one round: the trees built from wheels, a dataset, a validation job and two
    training runs with --cache ram whose memory is read from /proc."""
    carry = tmp_path / 'carry'
    shutil.copytree(cache_dir() / 'wheels', carry / 'upstream-wheels')  # what prepare_trees.py pack would carry
    cmd = [sys.executable, KIT / 'bench' / 'run_bench.py', 'val-cache', '--dry-run', '--dataset', 'demo',
           '--pairs', 1, '--out', tmp_path / 'out', '--work', tmp_path / 'work', '--carry', carry]
    result = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=800, env=offline_env)
    assert result.returncode == 0, describe(result)
    record = json.loads((tmp_path / 'out' / 'results.json').read_text())
    assert record['mode'].startswith('dry-run') and list(record['targets']) == REQUIRED
    assert record['targets']['ram_cache_2ranks_vs_1rank'] == 1.0
    assert record['targets']['val_2gpu_vs_rank0'] > 0
    validation = record['pairs']['val_2gpu_vs_rank0']
    assert len(validation['pairs']) == 1 and validation['pairs'][0]['metrics_identical']
    memory = record['pairs']['ram_cache_2ranks_vs_1rank']
    assert not memory['complete'], 'one pair is not the three a target needs'
    assert [p['cache_memory']['cache_files'] for p in (memory['pairs'][0]['a'], memory['pairs'][0]['b'])] == [1, 1]


def test_each_call_records_how_the_cpus_share_cores_and_caches(tmp_path):
    cpu0 = tmp_path / 'cpu0'
    (cpu0 / 'topology').mkdir(parents=True)
    (cpu0 / 'topology/thread_siblings_list').write_text('0,8\n')
    (tmp_path / 'cpuinfo').write_text('processor\t: 0\nmodel name\t: AMD EPYC 9654\n\nprocessor\t: 1\n')
    assert run_bench.cpu_topology(cpu0, tmp_path / 'cpuinfo') == {
        'model': 'AMD EPYC 9654', 'cpu0_shares_its_core_with': '0,8', 'cpu0_shares_its_l3_with': None, 'l3': None}
    assert set(run_bench.machine(False)['cpu']) == {'model', 'cpu0_shares_its_core_with', 'cpu0_shares_its_l3_with',
                                                    'l3'}
