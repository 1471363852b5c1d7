#!/usr/bin/env python3
"""The kit against upstream on a machine with N GPUs: one call measures one or two whole comparisons, each as
alternating pairs (A, B, A, B, ...), every pair recorded, the target the median of the pairs' ratios.

    python bench/run_bench.py CALL --out DIR [--gpus N] [--pairs 3] [--deadline-s S]         on the GPU machine
    python bench/run_bench.py CALL --out DIR --dry-run [--gpus 2]                            CPUs, gloo, tiny sizes

CALL (docs/benchmarks.md has the figures and their commands; bench/results.py the targets):
  per-gpu      upstream train_dual.py on N GPUs | the kit on N GPUs                -> per_gpu_vs_upstream_Ngpu
               (--task detect or detect-triple: train.py | ddp_train.py, or train_triple.py | ddp_train_triple.py,
               with ENTRY_POINT_CFGS' model; its series keyed '... (TASK)', no target; per-gpu-det too)
               (on one GPU also -> peak_memory_vs_upstream_b32_1gpu)
  short-job    upstream train_dual.py | the kit, one GPU, a whole fine-tune: 6 epochs of 512 images, batch 16,
               validation every epoch                     -> short_job_vs_upstream_1gpu, first_epoch_vs_upstream_1gpu,
                                                             peak_memory_vs_upstream_b16_1gpu,
                                                             epoch_end_beyond_validation_s_1gpu
  fits         upstream train_dual.py | the kit, one GPU, 2 epochs of short-job's fine-tune at batch 32, a ballast
               process leaving upstream's peak + 15% free   -> fits_where_upstream_fits_1gpu (1 or 0)
  shared-node  4 runs of upstream train_dual.py at once | 4 of the kit, one GPU and the node's CPUs shared, 80 s
               each side, 128 images at 320 px, batch 16    -> shared_node_epochs_vs_upstream (epochs completed)
  per-gpu-det  upstream train_dual.py | the kit | the kit with --deterministic, N GPUs, 2048 images
                                                                                   -> per_gpu_vs_upstream_Ngpu,
                                                                                      deterministic_vs_upstream_Ngpu
  scaling      the kit on 1 GPU | the kit on N GPUs                                -> scaling_Ngpu
  loop-lever   the kit | its GPU-only step [| the GPU-only step with --levers LEVER: --lever LEVER], 2048 images
                                                                                   -> in_loop_vs_gpu_only_Ngpu
                                                                                      (and lever LEVER, no target)
  val-cache    rank-0 | distributed validation (one job); the kit with --cache ram on 1 | N GPUs
                                                                                   -> val_Ngpu_vs_rank0,
                                                                                      ram_cache_Nranks_vs_1rank
  parity       per seed: the kit on 1 GPU | on N GPUs | on N GPUs with upstream's numerics, trained to the end
               (on one GPU: the kit | upstream's numerics)                         -> parity_map50_95_points
  ckpt-windows one run of the kit on 1 GPU, one long epoch (the main dataset repeated, as links) with a periodic
               checkpoint every 2W s: the W s around each | the W/2 s before and after that, which have none
               (bench/ckpt_windows.py, --window-s W, default 60)
                                                            -> checkpoint_minutes_W/60_vs_none_1gpu: with W = 60,
                                                               checkpoint_minutes_1_vs_none_1gpu itself
  entry-points every kit entry point (ddp_train.py, ..., segment/ddp_train_dual.py) trains on N GPUs: a whole
               short run each, an upstream model of its kind on its task's demo data  -> entry_points (no target)

Throughput is timed from outside the training process, the same way for both programs: the second epoch's images
over the time between the first and second rows of results.csv (the first epoch, with start-up, autotuning and
worker start, is excluded; the run is stopped there). The kit's in-loop figure is its own
'epoch 1: ... img/s' log line (the loop alone, without the epoch's end). Each run's figures, and the pairs and
targets so far, are written to OUT/results.json after every round; a round that would end past --deadline-s is not
started, so a call always returns its figures.

Everything is prepared on the machine from what travels: the trees (bench/prepare_trees.py, from .bench) and the
dataset (bench/photo_data.py: photographs at COCO's sizes, generated from a seed).
"""
import argparse
import csv
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

KIT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(KIT))

from bench import photo_data, prepare_trees, results  # noqa: E402
from testsupport import imagecache  # noqa: E402
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset, generated_dataset  # noqa: E402
from yolov9_ddp.tasks import TASKS  # noqa: E402

NCCL_SAFETY = {'NCCL_NVLS_ENABLE': '0', 'TORCH_SYMM_MEM_DISABLE_MULTICAST': '1', 'NVSHMEM_DISABLE_NVLS': '1'}
TINY_CFG = str(KIT / 'yolov9_ddp' / 'models' / 'tiny-dual.yaml')
IN_LOOP = re.compile(r'epoch (\d+): (\d+) images in ([\d.]+) s \(([\d.]+) img/s\)')
EPOCH_END = re.compile(r'validation ([\d.]+) s, epoch end ([\d.]+) s')  # the kit's 'epoch N: ...' line
RESERVED = re.compile(r'epoch end [\d.]+ s; peak reserved MiB per rank (\d+)')  # its GPU 0's, on the same line
FINAL_MAP = re.compile(r'Final:.*mAP50-95 ([\d.]+)')
FINAL_LINE = re.compile(r'Final:\S* (.*?)  \(')  # the metrics of the final validation, any task's
# an upstream model of each entry point's kind (the kit's tiny ones in a dry run)
DEFAULT_TASK = 'detect-dual'  # train_dual.py | ddp_train_dual.py: the targets' comparison
ENTRY_POINT_CFGS = {'detect': 'models/detect/gelan-s.yaml', 'detect-dual': 'models/detect/yolov9-s.yaml',
                    'detect-triple': 'models/detect/yolov9-cf.yaml', 'segment': 'models/segment/gelan-c-seg.yaml',
                    'segment-dual': 'models/segment/yolov9-c-dseg.yaml'}

# Sizes of a GPU call and of a dry run (CPUs, a few seconds a run; the model is the task's, Bench.model_of): images
# per GPU, the datasets (main: 4096 images; short: 3072 where a call's three rounds need the time, scaling and step;
# small: 2048, where three runs a round must fit one 10-minute call on one GPU).
SIZES = {
    'gpu': dict(imgsz=640, batch_per_gpu=32, workers=8, deadline_s=530,
                main=photo_data.PhotoSpec(train=4096, val=1000), short=photo_data.PhotoSpec(train=3072, val=1000),
                memory=photo_data.PhotoSpec(train=2048, val=1000), small=photo_data.PhotoSpec(train=2048, val=1000),
                parity=photo_data.PhotoSpec(train=4096, val=500, scale=0.5), parity_imgsz=256, parity_batch=64,
                parity_epochs=4, steps=(15, 40), run_timeout_s=300,
                entry=dict(train=1024, val=256, imgsz=320, epochs=3, batch_per_gpu=16),
                quick_entry=dict(train=64, val=32, imgsz=160, epochs=1, batch_per_gpu=8),
                ckpt_copies=48,  # 48 x 4096 images: 504 s at 390 img/s, past the (2P + 1) W = 420 s of W = 60, P = 3
                fine_tune=photo_data.PhotoSpec(train=512, val=128), fine_tune_epochs=6, fine_tune_batch=16,
                shared=photo_data.PhotoSpec(train=128, val=32), shared_imgsz=320, shared_runs=4, shared_s=80),
    'dry-run': dict(imgsz=64, batch_per_gpu=4, workers=1, deadline_s=1500,
                    **{name: photo_data.PhotoSpec(train=32, val=16, scale=0.2)
                       for name in ('main', 'short', 'memory', 'small', 'parity')},
                    parity_imgsz=64, parity_batch=8, parity_epochs=2, steps=(2, 3), run_timeout_s=300,
                    entry=dict(train=16, val=8, imgsz=64, epochs=1, batch_per_gpu=4),
                    quick_entry=dict(train=16, val=8, imgsz=64, epochs=1, batch_per_gpu=4), ckpt_copies=100,
                    fine_tune=photo_data.PhotoSpec(train=32, val=16, scale=0.2), fine_tune_epochs=2,
                    fine_tune_batch=4, shared=photo_data.PhotoSpec(train=16, val=8, scale=0.2), shared_imgsz=64,
                    shared_runs=2, shared_s=25),
}


class RunFailed(Exception):
    """A run ended without its figures; the message has the end of its log."""


class Bench:
    def __init__(self, args):
        self.args, self.n = args, args.gpus
        self.mode = 'dry-run' if args.dry_run else 'gpu'
        self.size = SIZES[self.mode]
        self.cuda = not args.dry_run
        self.out, self.work = Path(args.out), Path(args.work)
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs = self.work / 'logs'  # the full logs stay on the machine; failed runs' tails go to results.json
        self.logs.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.deadline = args.deadline_s or self.size['deadline_s']
        self.env = {**os.environ, **NCCL_SAFETY, 'PYTHONUNBUFFERED': '1', 'MPLBACKEND': 'Agg'}
        if args.dry_run:
            self.env.update(OMP_NUM_THREADS='1', GLOO_SOCKET_IFNAME='lo')
        self.record = {'mode': 'gpu' if self.cuda else 'dry-run (CPU, gloo)', 'gpus': self.n,
                       'machine': machine(self.cuda), 'calls': [], 'datasets': {}, 'pairs': {}}
        self.call = {'call': args.call, 'command': ' '.join(sys.argv), 'date': time.strftime('%F %T')}
        self.record['calls'].append(self.call)
        trees = prepare_trees.ensure_trees(self.work / 'trees', Path(args.carry).resolve())
        self.upstream, self.kit = trees / 'upstream', trees / 'kit'

    # -- bookkeeping ------------------------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def save(self):
        self.call['wall_s'] = round(self.elapsed())
        self.record['targets'] = results.targets_from(self.record['pairs'], self.n)
        if self.n == 1:
            self.record['targets'].update(results.one_gpu_targets(self.record['pairs']))
        (self.out / 'results.json').write_text(json.dumps(self.record, indent=1) + '\n')

    def dataset(self, name: str) -> str:
        spec, ensure = self.size[name], photo_data.ensure_photo_dataset
        if self.args.dataset == 'demo':  # flat shapes, for a dry run where scikit-image is missing
            spec = DemoSpec(train=spec.train, val=spec.val, imgsz=max(32, round(640 * spec.scale)), max_objects=8)
            ensure = ensure_demo_dataset
        root = self.work / f'data-{name}-{self.args.dataset}-{spec.train}-{spec.val}'
        started = time.monotonic()
        data_yaml = ensure(root, spec, processes=os.cpu_count())
        if str(root) not in self.record['datasets']:
            self.record['datasets'][str(root)] = {'spec': repr(spec), 'generated_s': round(time.monotonic() - started),
                                                  **photo_data.file_stats(root)}
        return str(data_yaml)

    def rounds(self, runs: dict, pairs: dict):
        """runs {label: run(i)} in order, round after round; after each round every pair series
        {key: (label_a, label_b, ratio(a, b), what)} gets the round's pair. Stops at --pairs rounds, or before a
        round that the slowest round so far says would end past the deadline."""
        for key, (label_a, label_b, _, what) in pairs.items():
            self.record['pairs'][key] = {'call': self.args.call, 'a': label_a, 'b': label_b, 'ratio_is': what,
                                         'pairs': []}
        slowest = 0.0
        for i in range(self.args.pairs):
            if i and self.elapsed() + slowest > self.deadline:
                self.call['stopped'] = f'round {i + 1} would end past the deadline of {self.deadline} s'
                break
            started, figures = time.monotonic(), {}
            for label, run in runs.items():
                try:
                    figures[label] = run(i)
                except RunFailed as e:
                    figures[label] = {'error': str(e)}
            for key, (label_a, label_b, ratio, _) in pairs.items():
                a, b = figures[label_a], figures[label_b]
                value = None if 'error' in a or 'error' in b else ratio(a, b)
                self.record['pairs'][key]['pairs'].append({'a': a, 'b': b, 'ratio': value})
                self.record['pairs'][key] = results.summarise(self.record['pairs'][key])
            slowest = max(slowest, time.monotonic() - started)
            self.save()
            print(f'== round {i + 1} ({time.monotonic() - started:.0f} s): ' + ', '.join(
                f'{key} {series["pairs"][-1]["ratio"]}' for key, series in self.record['pairs'].items()
                if key in pairs), flush=True)

    # -- one training run, timed from outside -----------------------------------------------------------------------

    def train_cmd(self, tree, gpus, data, name, epochs=3, extra=(), cfg=None, imgsz=None, batch=None, seed=0,
                  task=TASKS[DEFAULT_TASK], workers=None):
        upstream = tree == self.upstream
        size = self.size
        batch = batch or size['batch_per_gpu'] * gpus
        if workers is None:
            workers = size['workers'] if upstream else os.cpu_count()  # the kit caps it by its CPUs
        device = ','.join(str(i) for i in range(gpus)) if self.cuda else 'cpu'
        args = ['--data', data, '--cfg', cfg or self.model_of(task), '--hyp', 'data/hyps/hyp.scratch-high.yaml',
                '--epochs', epochs, '--batch-size', batch, '--imgsz', imgsz or size['imgsz'], '--workers', workers,
                '--device', device, '--seed', seed, '--project', self.work / 'runs', '--name', name, '--exist-ok',
                '--noplots', *extra]
        return [str(x) for x in [*launcher(gpus), task.upstream if upstream else task.script, *args]]

    def model_of(self, task) -> str:
        """The model a task's runs train: an upstream model of its kind on GPUs, the kit's tiny one in a dry run."""
        return ENTRY_POINT_CFGS[task.name] if self.cuda else str(KIT / 'yolov9_ddp' / 'models' / task.demo_cfg)

    def task(self):
        """(task, key suffix) of --task: train_dual.py's series are the targets' own, another script's say which."""
        task = TASKS[self.args.task]
        return task, '' if task.name == DEFAULT_TASK else f' ({task.name})'

    def launch(self, name, cmd, tree):
        """(process, log path): cmd started in tree, in a session of its own, its output going to logs/NAME.log."""
        log_path = self.logs / f'{name}.log'
        with open(log_path, 'w') as log:
            proc = subprocess.Popen(cmd, cwd=tree, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return proc, log_path

    def run_to_end(self, name, cmd, tree, timeout_fails=True, timeout=None):
        """(process, log path) of cmd run to its end; stopped after timeout (run_timeout_s), which is a RunFailed
        unless timeout_fails is False (then the caller reads what the log holds)."""
        proc, log_path = self.launch(name, cmd, tree)
        try:
            proc.wait(timeout=timeout or self.size['run_timeout_s'])
        except subprocess.TimeoutExpired:
            if timeout_fails:
                raise RunFailed(f'{name} timed out: {log_tail(log_path)}') from None
        finally:
            stop(proc, self.cuda)
        return proc, log_path

    def train(self, name, cmd, tree, images, rows=2, memory_at_row=None, to_the_end=False) -> dict:
        """Run until results.csv has `rows` rows (to_the_end: until the run exits, and its seconds); img/s of the
        last epoch, the kit's in-loop figures and epoch ends, peak GPU memory and (memory_at_row) the node's memory for
        the image cache when that row lands."""
        csv_path = self.work / 'runs' / name / 'results.csv'
        csv_path.unlink(missing_ok=True)
        sampler = GpuSampler() if self.cuda else None
        started, stamps, cache = time.monotonic(), [], None
        proc, log_path = self.launch(name, cmd, tree)
        try:
            while to_the_end or len(stamps) < rows:
                new = count_rows(csv_path) - len(stamps)
                stamps += [time.monotonic()] * max(new, 0)
                if memory_at_row and len(stamps) >= memory_at_row and cache is None:
                    cache = imagecache.node_cache_report(imagecache.descendants(proc.pid))
                if len(stamps) >= rows and not to_the_end:
                    break
                if proc.poll() is not None and count_rows(csv_path) <= len(stamps):
                    if to_the_end and proc.returncode == 0 and len(stamps) >= rows:
                        break
                    raise RunFailed(f'{name} exited with {proc.returncode} after {len(stamps)} epochs: '
                                    f'{log_tail(log_path)}')
                if time.monotonic() - started > self.size['run_timeout_s']:
                    raise RunFailed(f'{name} timed out after {len(stamps)} epochs: {log_tail(log_path)}')
                time.sleep(0.05)
        finally:
            ended = time.monotonic()
            stop(proc, self.cuda)
            peaks = sampler.stop() if sampler else None
        text = log_path.read_text(errors='replace')
        loop = [dict(zip(('epoch', 'images', 'seconds', 'img_per_s'), map(float, m.groups())))
                for m in IN_LOOP.finditer(text)]
        figures = {'first_epoch_end_s': round(stamps[0] - started, 1), 'command': ' '.join(cmd)}
        if to_the_end:
            figures['seconds'] = round(ended - started, 1)
        beyond = [float(end) - float(validation) for validation, end in EPOCH_END.findall(text)]
        if beyond:
            figures['epoch_end_beyond_validation_s'] = round(statistics.median(beyond), 3)
        if RESERVED.search(text):  # whether reserved memory grows after the first epoch
            figures['reserved_mib_by_epoch'] = [int(mib) for mib in RESERVED.findall(text)]
        if rows > 1:
            figures.update(img_per_s=round(images / (stamps[-1] - stamps[-2]), 1),
                           epoch_s=round(stamps[-1] - stamps[-2], 2))
        if loop:
            figures['in_loop_img_per_s'] = loop[-1]['img_per_s']
        if peaks:
            figures['peak_mem_mib'] = peaks
        if sampler and rows > 1:
            figures['gpu0'] = sampler.during(stamps[-2], stamps[-1])  # the timed epoch
        if cache:
            figures['cache_memory'] = cache
        print(f'   {name}: {json.dumps({k: v for k, v in figures.items() if k != "command"})}', flush=True)
        return figures

    def fine_tune(self, tree, name, data, epochs, batch) -> dict:
        """A whole one-GPU fine-tune on the fine_tune photographs (data), timed from launch to exit."""
        cmd = self.train_cmd(tree, 1, data, name, epochs=epochs, batch=batch)
        return self.train(name, cmd, tree, self.size['fine_tune'].train, rows=1, to_the_end=True)

    def train_to_the_end(self, name, cmd, tree) -> dict:
        """A whole training run (parity): its final mAP50-95, best.pt validated again at the end."""
        started = time.monotonic()
        proc, log_path = self.run_to_end(name, cmd, tree)
        final = FINAL_MAP.findall(log_path.read_text(errors='replace'))
        if proc.returncode or not final:
            raise RunFailed(f'{name} exited with {proc.returncode}: {log_tail(log_path)}')
        print(f'   {name}: mAP50-95 {final[-1]} in {time.monotonic() - started:.0f} s', flush=True)
        return {'map50_95': float(final[-1]), 'seconds': round(time.monotonic() - started),
                'best_row': best_row(self.work / 'runs' / name / 'results.csv'), 'command': ' '.join(cmd)}

    def job(self, name, script_args, gpus, tree, timeout=None) -> dict:
        """A bench script (gpu_step.py, val_time.py) run in tree on gpus processes; its JSON."""
        out = self.logs / f'{name}.json'
        out.unlink(missing_ok=True)
        cmd = [str(x) for x in [*launcher(gpus), *script_args[:1], out, *script_args[1:]]]
        sampler = GpuSampler() if self.cuda else None
        try:
            proc, log_path = self.run_to_end(name, cmd, tree, timeout=timeout)
        finally:
            ended = time.monotonic()
            if sampler:
                sampler.stop()
        if proc.returncode or not out.exists():
            raise RunFailed(f'{name} exited with {proc.returncode}: {log_tail(log_path)}')
        figures = {**json.loads(out.read_text()), 'command': ' '.join(cmd)}
        if sampler:  # gpu_step.py times its last steps: the job's last seconds, before its teardown
            figures['gpu0'] = sampler.during(ended - 6, ended)
        print(f'   {name}: {json.dumps({k: v for k, v in figures.items() if k != "command"})[:300]}', flush=True)
        return figures

    # -- the calls --------------------------------------------------------------------------------------------------

    def end_to_end(self, tree, tag: str, dataset: str, extra=(), task=TASKS[DEFAULT_TASK]):
        """run(i): the i-th end-to-end training of tree on the dataset, N GPUs, --noval, global batch
        batch_per_gpu x N, the task's script and model. Upstream's scripts refuse DDP without CUDA ('insufficient
        CUDA devices'): a dry run on several processes runs them on one process, with the same global batch."""
        data, n, images = self.dataset(dataset), self.n, self.size[dataset].train
        gpus = 1 if tree == self.upstream and not self.cuda else n

        def run(i):
            name = f'{tag}-{n}gpu-{i}'
            return self.train(name, self.train_cmd(tree, gpus, data, name, extra=['--noval', *extra],
                                                   batch=self.size['batch_per_gpu'] * n, task=task), tree, images)
        return run

    def per_gpu(self):
        (chosen, suffix), (task, task_suffix) = kit_levers(self.args.kit_levers), self.task()
        key = f'per_gpu_vs_upstream_{self.n}gpu{task_suffix}{suffix}'
        pairs = {key: ('upstream', 'kit', lambda a, b: ratio(b, a, 'img_per_s'),
                       of_script(results.TARGETS['per_gpu_vs_upstream_{n}gpu'], task))}
        if self.n == 1:  # a batch of 32 on one GPU
            pairs[f'peak_memory_vs_upstream_b32_1gpu{task_suffix}{suffix}'] = (
                'upstream', 'kit', peak_memory_ratio, results.ONE_GPU_TARGETS['peak_memory_vs_upstream_b32_1gpu'])
        self.rounds({'upstream': self.end_to_end(self.upstream, 'upstream', 'main', task=task),
                     'kit': self.end_to_end(self.kit, 'kit', 'main', chosen, task=task)}, pairs)
        if not self.cuda:
            self.record['pairs'][key]['note'] = f"dry run: {task.upstream} refuses DDP without CUDA, so upstream's " \
                                                'runs were one process (same global batch)'

    def short_job(self):
        """A fine-tune as most one-GPU users run it, a whole job of a few hundred images with validation every epoch:
        upstream's train_dual.py | the kit, on one GPU. Its seconds, from launch to the first results row, peak GPU
        memory, and the kit's epoch end beyond validation (its 'epoch N:' log lines)."""
        size, data = self.size, self.dataset('fine_tune')

        def whole(tree, tag):
            return lambda i: self.fine_tune(tree, f'{tag}-short-{i}', data, size['fine_tune_epochs'],
                                            size['fine_tune_batch'])
        targets = results.ONE_GPU_TARGETS
        self.rounds({'upstream': whole(self.upstream, 'upstream'), 'kit': whole(self.kit, 'kit')}, {
            'short_job_vs_upstream_1gpu': ('upstream', 'kit', lambda a, b: ratio(a, b, 'seconds'),
                                           targets['short_job_vs_upstream_1gpu']),
            'first_epoch_vs_upstream_1gpu': ('upstream', 'kit', lambda a, b: ratio(a, b, 'first_epoch_end_s'),
                                             targets['first_epoch_vs_upstream_1gpu']),
            'peak_memory_vs_upstream_b16_1gpu': ('upstream', 'kit', peak_memory_ratio,
                                                 targets['peak_memory_vs_upstream_b16_1gpu']),
            'epoch_end_beyond_validation_s_1gpu': ('upstream', 'kit',
                                                   lambda a, b: b.get('epoch_end_beyond_validation_s'),
                                                   targets['epoch_end_beyond_validation_s_1gpu'])})

    def fits(self):
        """The same command fits where upstream's does: a ballast process leaves upstream's own peak (nvidia-smi,
        from a run of it alone first) plus 15% of GPU 0 free, and then upstream | the kit train a 2-epoch fine-tune
        at batch 32 (the tighter batch). A pair is 1 where the kit completed, 0 where it did not; a pair where
        upstream did not complete has no figure. No ballast on CPUs."""
        size, data = self.size, self.dataset('fine_tune')

        def job(tree, tag, leave_mib=None, may_fail=False):
            def run(i):
                with Ballast(leave_mib if self.cuda else None) as ballast:
                    try:
                        return {**self.fine_tune(tree, f'{tag}-fits-{i}', data, 2, 2 * size['fine_tune_batch']),
                                'completed': 1, 'ballast_mib': ballast.mib}
                    except RunFailed as e:
                        if not may_fail:
                            raise
                        return {'completed': 0, 'ballast_mib': ballast.mib, 'failure': str(e)[-1500:]}
            return run
        alone = job(self.upstream, 'upstream-alone')(0)
        leave = round(alone['peak_mem_mib'][0] * FITS_HEADROOM) if 'peak_mem_mib' in alone else None
        self.call['fits_free_mib'] = leave
        self.rounds({'upstream': job(self.upstream, 'upstream', leave),
                     'kit': job(self.kit, 'kit', leave, may_fail=True)}, {
            'fits_where_upstream_fits_1gpu': ('upstream', 'kit', lambda a, b: b['completed'],
                                              results.ONE_GPU_TARGETS['fits_where_upstream_fits_1gpu'])})

    def shared_node(self):
        """Single-GPU runs sharing one GPU and the node's CPUs, as a hyperparameter sweep runs them: shared_runs runs
        of upstream at once | as many of the kit, each side for shared_s seconds with the same command (seeds apart,
        upstream's default --workers 8); the epochs they completed meanwhile (results.csv rows), summed."""
        size, data = self.size, self.dataset('shared')

        def side(tree, tag):
            def run(i):
                runs = []
                for k in range(size['shared_runs']):
                    name = f'{tag}-shared-{i}-{k}'
                    csv_path = self.work / 'runs' / name / 'results.csv'
                    csv_path.unlink(missing_ok=True)
                    cmd = self.train_cmd(tree, 1, data, name, epochs=1000, imgsz=size['shared_imgsz'], seed=k,
                                         batch=size['fine_tune_batch'], workers=size['workers'])
                    runs.append((*self.launch(name, cmd, tree), csv_path))
                try:
                    time.sleep(size['shared_s'])
                    epochs = [count_rows(csv_path) for _, _, csv_path in runs]
                    for proc, log_path, _ in runs:
                        if proc.poll() is not None:
                            raise RunFailed(f'{tag} run exited with {proc.returncode}: {log_tail(log_path)}')
                finally:
                    for proc, *_ in runs:
                        stop(proc, cuda=False)
                    time.sleep(2 if self.cuda else 0)  # the GPU's memory drains
                figures = {'epochs': sum(epochs), 'per_run': epochs, 'seconds': size['shared_s']}
                print(f'   {tag}-shared-{i}: {json.dumps(figures)}', flush=True)
                return figures
            return run
        self.rounds({'upstream': side(self.upstream, 'upstream'), 'kit': side(self.kit, 'kit')}, {
            'shared_node_epochs_vs_upstream': ('upstream', 'kit', lambda a, b: ratio(b, a, 'epochs'),
                                               results.ONE_GPU_TARGETS['shared_node_epochs_vs_upstream'])})

    def per_gpu_det(self):
        """The kit end to end, and with --deterministic, against upstream, alternated in one call; 2048 images, so
        that three rounds of three runs fit one call on one GPU."""
        n, (chosen, suffix), (task, task_suffix) = self.n, kit_levers(self.args.kit_levers), self.task()
        deterministic, suffix = ['--deterministic', *chosen], task_suffix + suffix
        self.rounds({'upstream': self.end_to_end(self.upstream, 'upstream-d', 'small', task=task),
                     'kit': self.end_to_end(self.kit, 'kit-d', 'small', chosen, task=task),
                     'kit --deterministic': self.end_to_end(self.kit, 'kit-det', 'small', deterministic, task=task)}, {
            f'per_gpu_vs_upstream_{n}gpu{suffix}': ('upstream', 'kit', lambda a, b: ratio(b, a, 'img_per_s'),
                                                    of_script(results.TARGETS['per_gpu_vs_upstream_{n}gpu'], task)),
            f'deterministic_vs_upstream_{n}gpu{suffix}': ('upstream', 'kit --deterministic',
                                                          lambda a, b: ratio(b, a, 'img_per_s'),
                                                          of_script(results.ONE_GPU_TARGETS[
                                                              'deterministic_vs_upstream_1gpu'], task))})

    def loop_lever(self):
        """The kit's in-loop rate against its GPU-only step, alternated in one call (2048 images); --lever L adds the
        GPU-only step with --levers L, which says what L does to the step without the loop around it."""
        data, n, images, lever = self.dataset('small'), self.n, self.size['small'].train, self.args.lever
        warmup, steps = self.size['steps']

        def gpu_only(extra, tag):
            def run(i):
                name = f'step-{tag}-{n}gpu-{i}'
                args = [KIT / 'bench' / 'gpu_step.py', '--warmup', warmup, '--steps', steps,
                        *self.train_cmd(self.kit, n, data, name)[len(launcher(n)) + 1:], *extra]
                return self.job(name, args, n, self.kit)
            return run
        runs = {'kit': lambda i: self.train(f'kit-l-{n}gpu-{i}', self.train_cmd(
                    self.kit, n, data, f'kit-l-{n}gpu-{i}', extra=['--noval']), self.kit, images),
                'gpu-only': gpu_only([], 'defaults')}
        pairs = {f'in_loop_vs_gpu_only_{n}gpu': ('kit', 'gpu-only', lambda a, b: round(
            a['in_loop_img_per_s'] / b['img_per_s'], 4), results.ONE_GPU_TARGETS['in_loop_vs_gpu_only_1gpu'])}
        if lever:
            runs[f'gpu-only {lever}'] = gpu_only(['--levers', lever], lever_tag(lever))
            pairs[f'lever {lever} (GPU-only step)'] = (
                'gpu-only', f'gpu-only {lever}', lambda a, b: ratio(b, a, 'img_per_s'),
                f'GPU-only step img/s with --levers {lever} / with the defaults')
        self.rounds(runs, pairs)

    def ckpt_windows(self):
        """One run of the kit on one GPU (bench/ckpt_windows.py) pairs the W seconds around each periodic
        checkpoint with the W/2 before and the W/2 after them, which hold none. Its warm-up is shortened to 100 steps
        (upstream's 3 epochs would be the whole run here, its accumulation and learning rate changing under the
        windows)."""
        window, copies = self.args.window_s, self.size['ckpt_copies']
        chosen, suffix = kit_levers(self.args.kit_levers)
        data = repeated(self.dataset('main'), copies)
        hyp = self.work / 'hyp-short-warmup.yaml'
        hyp.write_text(re.sub(r'^warmup_epochs: .*$', 'warmup_epochs: 0  # 100 steps, the least',
                              (self.kit / 'data/hyps/hyp.scratch-high.yaml').read_text(), flags=re.M))
        key = results.checkpoint_key(window / 60, 1) + suffix
        series = {'call': self.args.call, 'a': f'{window:g} s without a checkpoint, half before it and half after',
                  'b': f'{window:g} s around one periodic checkpoint', 'ratio_is': results.checkpoint_what(
                      window / 60, '1 GPU, windows of one run (bench/ckpt_windows.py)'), 'pairs': []}
        name = 'ckpt-windows-1gpu'
        args = self.train_cmd(self.kit, 1, data, name, epochs=1, extra=['--noval', '--hyp', hyp, *chosen])
        script = [KIT / 'bench' / 'ckpt_windows.py', '--window-s', window, '--pairs', self.args.pairs]
        self.series_of_one_job(key, series, name, [*script, *args[len(launcher(1)) + 1:]], 1, lambda pairs: [
            {'a': p['without'], 'b': {**p['with'], 'checkpoints': {  # one in each window of W s
                'per_minute_in_timed_epoch': round(60 / window, 2)}, 'checkpoint': p['checkpoint']},
             'ratio': round(p['with']['img_per_s'] / p['without']['img_per_s'], 4)} for p in pairs],
            timeout=(2 * self.args.pairs + 2) * window + 120)

    def scaling(self):
        data, n, images = self.dataset('short'), self.n, self.size['short'].train

        def kit(gpus):
            return lambda i: self.train(f'kit-{gpus}gpu-s{i}', self.train_cmd(
                self.kit, gpus, data, f'kit-{gpus}gpu-s{i}', extra=['--noval']), self.kit, images)
        self.rounds({'kit-1gpu': kit(1), f'kit-{n}gpu': kit(n)}, {
            f'scaling_{n}gpu': ('kit-1gpu', f'kit-{n}gpu', lambda a, b: ratio(b, a, 'img_per_s'),
                                results.TARGETS['scaling_{n}gpu'])})

    def val_cache(self):
        self.validation()
        self.ram_cache_memory()

    def validation(self):
        """One job alternates the two ways itself; its pairs become the target's."""
        n, data = self.n, self.dataset('main')
        name = f'val-{n}gpu'
        key = f'val_{n}gpu_vs_rank0'
        series = {'call': self.args.call, 'a': 'rank-0 validation', 'b': f'distributed validation on {n}',
                  'ratio_is': results.TARGETS['val_{n}gpu_vs_rank0'], 'pairs': []}
        self.series_of_one_job(key, series, name, [KIT / 'bench' / 'val_time.py', '--pairs', self.args.pairs,
                                                   *self.train_cmd(self.kit, n, data, name)[len(launcher(n)) + 1:]],
                               n, lambda pairs: [{'a': {'seconds': p['rank0_s'], 'metrics': p['rank0_metrics']},
                                                  'b': {'seconds': p['distributed_s'],
                                                        'metrics': p['distributed_metrics']},
                                                  'metrics_identical': p['max_metric_difference'] <= 1e-6,
                                                  'ratio': round(p['distributed_s'] / p['rank0_s'], 4)}
                                                 for p in pairs])

    def series_of_one_job(self, key, series, name, script_args, gpus, pairs_of, timeout=None):
        """A kit job that alternates the two sides itself (val_time.py, ckpt_windows.py): pairs_of(its pairs) become
        the series under key, its other figures the series' 'job'; a job that fails leaves its error there."""
        try:
            job = self.job(name, script_args, gpus, self.kit, timeout)
            series['job'] = {k: v for k, v in job.items() if k != 'pairs'}
            series['pairs'] = pairs_of(job['pairs'])
        except RunFailed as e:
            series['error'] = str(e)
        self.record['pairs'][key] = results.summarise(series)
        self.save()

    def ram_cache_memory(self):
        data, n, images = self.dataset('memory'), self.n, self.size['memory'].train

        def cached(gpus):
            return lambda i: self.train(f'cache-{gpus}gpu-{i}', self.train_cmd(
                self.kit, gpus, data, f'cache-{gpus}gpu-{i}', extra=['--noval', '--cache', 'ram']), self.kit, images,
                rows=1, memory_at_row=1)
        self.rounds({'1 rank': cached(1), f'{n} ranks': cached(n)}, {
            f'ram_cache_{n}ranks_vs_1rank': ('1 rank', f'{n} ranks', lambda a, b: round(
                b['cache_memory']['resident_bytes'] / a['cache_memory']['resident_bytes'], 4),
                results.TARGETS['ram_cache_{n}ranks_vs_1rank'])})

    def parity(self):
        """Per seed, whole runs of the tiny model: the kit on 1 GPU | on N GPUs | on N GPUs with upstream's
        numerics; on one GPU the first run is the kit's, and the middle one is left out. --kit-levers L: the kit's
        runs (not upstream's numerics) train with --levers L."""
        n, data, size = self.n, self.dataset('parity'), self.size
        chosen, suffix = kit_levers(self.args.kit_levers)

        def trained(gpus, levers, tag=''):
            def run(i):
                name = f'parity-{gpus}gpu{tag}-seed{i}'
                return self.train_to_the_end(name, self.train_cmd(
                    self.kit, gpus, data, name, epochs=size['parity_epochs'], cfg=TINY_CFG, imgsz=size['parity_imgsz'],
                    batch=size['parity_batch'], seed=i, extra=['--noval', *levers]), self.kit)
            return run
        points = lambda a, b: round(abs(a['map50_95'] - b['map50_95']) * 100, 3)  # noqa: E731
        kit, upstream_numerics = ('1 GPU' if n == 1 else f'{n} GPUs'), f'{n} GPUs, upstream numerics'
        runs, pairs = {'1 GPU': trained(1, chosen)}, {}
        if n > 1:
            runs[kit] = trained(n, chosen)
            pairs[f'{results.PARITY}{suffix}/gpus'] = ('1 GPU', kit, points, 'mAP50-95 points apart: 1 GPU against '
                                                       'N GPUs, same global batch, epochs and seed')
        runs[upstream_numerics] = trained(n, ['--deterministic'], '-upstream-numerics')  # upstream's arithmetic
        pairs[f'{results.PARITY}{suffix}/numerics'] = (upstream_numerics, kit, points, "mAP50-95 points apart: the "
                                                       "kit's defaults against upstream's numerics (--deterministic), "
                                                       'same seed')
        self.rounds(runs, pairs)

    def entry_points(self):
        """Each kit entry point trains a whole short run on N GPUs (NCCL) with an upstream model of its kind, on its
        task's demo data (boxes; polygons for segmentation): the in-loop img/s of its last epoch, its final metrics.
        --kit-levers L: with --levers L, recorded as 'NAME (--levers L)' (an entry point that refuses L records its
        error line)."""
        n, size = self.n, self.size['quick_entry' if self.args.quick else 'entry']
        chosen, suffix = kit_levers(self.args.kit_levers)
        record = self.record.setdefault('entry_points', {})
        for name, task in TASKS.items():
            if self.elapsed() > self.deadline:
                record[name + suffix] = {'error': 'not run: the call reached its deadline'}
                continue
            spec = DemoSpec(train=size['train'], val=size['val'], imgsz=size['imgsz'],
                            labels='polygons' if task.masks else 'boxes')
            data = ensure_demo_dataset(self.work / f'entry-data-{spec.labels}', spec)
            cmd = self.train_cmd(self.kit, n, data, f'entry-{name}', epochs=size['epochs'], imgsz=size['imgsz'],
                                 batch=size['batch_per_gpu'] * n, extra=chosen, task=task)
            record[name + suffix] = self.whole_run(f'entry-{name}', cmd, self.kit)
            self.save()

    def whole_run(self, name, cmd, tree) -> dict:
        """A run to its end: its exit status, seconds, last in-loop img/s and final metrics (or the log's end)."""
        started = time.monotonic()
        proc, log_path = self.run_to_end(name, cmd, tree, timeout_fails=False)
        text = log_path.read_text(errors='replace')
        loop, final = IN_LOOP.findall(text), FINAL_LINE.findall(text)
        figures = {'exit': proc.returncode, 'seconds': round(time.monotonic() - started), 'command': ' '.join(cmd)}
        if loop:
            figures['in_loop_img_per_s'] = float(loop[-1][3])
        if final and proc.returncode == 0:
            figures['final'] = final[-1]
        else:
            figures['error'] = log_tail(log_path)
        print(f'   {name}: {json.dumps({k: v for k, v in figures.items() if k not in ("command", "error")})}',
              flush=True)
        return figures


CALLS = {'per-gpu': Bench.per_gpu, 'per-gpu-det': Bench.per_gpu_det, 'short-job': Bench.short_job,
         'fits': Bench.fits, 'shared-node': Bench.shared_node,
         'scaling': Bench.scaling, 'loop-lever': Bench.loop_lever, 'val-cache': Bench.val_cache,
         'parity': Bench.parity,
         'ckpt-windows': Bench.ckpt_windows, 'entry-points': Bench.entry_points}
# the options only some calls read, and which: any other call given one refuses it, rather than measure without it
READ_BY = {'kit_levers': ('per-gpu', 'per-gpu-det', 'parity', 'entry-points', 'ckpt-windows'),
           'task': ('per-gpu', 'per-gpu-det'), 'lever': ('loop-lever',),
           'quick': ('entry-points',), 'window_s': ('ckpt-windows',)}
# set after that check: None is 'not given'
OPTION_DEFAULTS = {'window_s': 60.0, 'task': DEFAULT_TASK}


@dataclass(frozen=True)
class Repeated:
    """A dataset whose training set is another's `copies` times over, as symbolic links named apart (upstream's
    loader keeps one entry per path), its validation set the other's: an epoch as long as `copies` of the other's."""
    source: str  # the other's data.yaml
    copies: int


def repeated(data_yaml: str, copies: int) -> str:
    source = Path(data_yaml).parent
    root = source.with_name(f'{source.name}-x{copies}')

    def write(folder: Path):
        for kind in ('images', 'labels'):
            (folder / kind / 'train').mkdir(parents=True)
            for file in sorted((source / kind / 'train').iterdir()):
                for k in range(copies):
                    (folder / kind / 'train' / f'{k:03d}-{file.name}').symlink_to(file)
            (folder / kind / 'val').symlink_to(source / kind / 'val')
        (folder / 'data.yaml').write_text(re.sub(r'^path: .*$', f'path: {root.resolve()}',
                                                 Path(data_yaml).read_text(), flags=re.M))
    return str(generated_dataset(root, Repeated(str(data_yaml), copies), 'repeated.json', 'a repeated dataset', write))


def of_script(what: str, task) -> str:
    """A target's description of train_dual.py's comparison, said of the task's upstream script."""
    return what.replace('train_dual.py', task.upstream)


def lever_tag(lever: str) -> str:
    """The lever in its runs' names: 'channels_last=1' -> 'channels_last-1'."""
    return re.sub(r'[^\w.,]+', '-', lever).strip('-')


def kit_levers(lever: str):
    """--kit-levers L: the kit's runs train with --levers L, and the series keys say so (' (--levers L)'), so that
    such a series never stands for a target, which is the defaults'."""
    return (['--levers', lever], f' (--levers {lever})') if lever else ([], '')


FITS_HEADROOM = 1.15  # the memory left free for a run of the fits call: upstream's peak and 15%


class Ballast:
    """GPU 0's memory held by a process of its own (a context manager) so that only leave_mib stay free; mib: what
    it holds. None (CPUs): nothing held."""
    CODE = ('import sys, torch; free, _ = torch.cuda.mem_get_info(0); '
            "held = torch.empty(max(free - int(sys.argv[1]) * 2 ** 20, 0), dtype=torch.uint8, device='cuda:0'); "
            'print(held.numel() // 2 ** 20, flush=True); sys.stdin.read()')

    def __init__(self, leave_mib):
        self.leave_mib, self.proc, self.mib = leave_mib, None, 0

    def __enter__(self):
        if self.leave_mib is not None:
            self.proc = subprocess.Popen([sys.executable, '-c', self.CODE, str(self.leave_mib)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
            line = self.proc.stdout.readline()
            if not line.strip().isdigit():
                self.__exit__()
                raise RunFailed(f'the ballast process could not hold GPU memory (exit {self.proc.returncode})')
            self.mib = int(line)
        return self

    def __exit__(self, *_):
        if self.proc is not None:
            self.proc.stdin.close()  # it ends, and its memory with it
            self.proc.wait(timeout=60)


def peak_memory_ratio(upstream: dict, kit: dict):
    """The kit's peak GPU memory (nvidia-smi, GPU 0) / upstream's; None on CPUs."""
    if 'peak_mem_mib' not in kit:
        return None
    return round(kit['peak_mem_mib'][0] / upstream['peak_mem_mib'][0], 4)


def ratio(numerator: dict, denominator: dict, figure: str) -> float:
    return round(numerator[figure] / denominator[figure], 4)


def launcher(gpus: int) -> list:
    return [sys.executable] if gpus == 1 else \
        [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', str(gpus)]


def machine(cuda: bool) -> dict:
    import torch
    info = {'python': platform.python_version(), 'torch': torch.__version__, 'cpus': os.cpu_count(),
            'host': platform.node(), 'cpu': cpu_topology()}
    if cuda:
        info['gpus'] = subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True).stdout.strip().splitlines()
    return info


def cpu_topology(cpu0=Path('/sys/devices/system/cpu/cpu0'), cpuinfo=Path('/proc/cpuinfo')) -> dict:
    """The CPUs as Linux shows them: whether the training thread can share a core (its hyperthread) or the last-level
    cache with loader workers, whose work can slow the loop's host side."""
    def read(path: Path):
        try:
            return path.read_text().strip()
        except OSError:
            return None
    models = [line.split(':', 1)[1].strip() for line in (read(cpuinfo) or '').splitlines()
              if line.startswith('model name')]
    return {'model': models[0] if models else None,
            'cpu0_shares_its_core_with': read(cpu0 / 'topology/thread_siblings_list'),
            'cpu0_shares_its_l3_with': read(cpu0 / 'cache/index3/shared_cpu_list'),
            'l3': read(cpu0 / 'cache/index3/size')}


class GpuSampler:
    """nvidia-smi every 0.2 s: peak memory.used per GPU, and GPU 0's SM clock, power and temperature, so that a run's
    figures say what the GPU ran at meanwhile (a GPU-only step timed over 4 s and an epoch trained for a minute may
    not run at one clock). command: nvidia-smi's, or a stand-in's that prints such lines (tests)."""
    QUERY = 'index,memory.used,clocks.sm,power.draw,temperature.gpu'
    NVIDIA_SMI = ['nvidia-smi', f'--query-gpu={QUERY}', '--format=csv,noheader,nounits', '-lms', '200']

    def __init__(self, command=NVIDIA_SMI, clock=time.monotonic):
        self.peaks, self.samples, self.clock = {}, [], clock
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self):
        for line in self.proc.stdout:
            try:
                index, used, sm_mhz, power_w, temp_c = (float(x) for x in line.split(','))
            except ValueError:  # a field the GPU does not report ('[N/A]')
                continue
            self.peaks[int(index)] = max(self.peaks.get(int(index), 0), int(used))
            if index == 0:
                self.samples.append((self.clock(), sm_mhz, power_w, temp_c))

    def stop(self):
        self.proc.terminate()
        self.thread.join(timeout=2)
        return self.peaks

    def during(self, start: float, end: float) -> dict:
        """GPU 0 from start to end (self.clock's seconds): median SM clock and power, highest temperature."""
        inside = [sample for sample in self.samples if start <= sample[0] <= end]
        if not inside:
            return {}
        _, sm_mhz, power_w, temp_c = zip(*inside)
        return {'sm_mhz': statistics.median(sm_mhz), 'power_w': round(statistics.median(power_w)),
                'temp_c_max': max(temp_c), 'samples': len(inside)}


def log_tail(path: Path) -> str:
    text = path.read_text(errors='replace').replace('\r', '\n') if path.exists() else ''
    return '\n'.join(line for line in text.splitlines() if line.strip() and '%|' not in line)[-3000:]


def count_rows(path: Path) -> int:
    try:
        return max(0, len(path.read_text().strip().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def best_row(path: Path):
    try:
        with open(path) as f:
            rows = [{k.strip(): v.strip() for k, v in row.items()} for row in csv.DictReader(f)]
    except FileNotFoundError:
        return None
    return max(rows, key=lambda r: float(r['metrics/mAP_0.5:0.95'])) if rows else None


def stop(proc, cuda: bool):
    """End a run and every process it started: SIGTERM to the launcher (torchrun passes it on to the ranks, which
    stop their loader workers), then SIGKILL to whatever of them is left. torchrun starts each rank in a process
    group of its own, so they are found as the launcher's descendants, before it goes."""
    family = imagecache.descendants(proc.pid) if proc.poll() is None else []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    if cuda:
        time.sleep(2)  # let the GPUs' memory drain before the next run


def refuse_unread_options(parser, args):
    """One line for an option the call does not read (READ_BY); then the defaults of those given no value."""
    for dest, calls in READ_BY.items():
        if getattr(args, dest) not in (None, False, '') and args.call not in calls:
            parser.error(f'--{dest.replace("_", "-")}: the {args.call} call does not read it (only {", ".join(calls)})')
    for dest, default in OPTION_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('call', choices=CALLS)
    p.add_argument('--out', required=True, help='OUT/results.json gets the pairs and targets')
    p.add_argument('--gpus', type=int, default=None, help='default: every GPU (2 processes in a dry run)')
    p.add_argument('--pairs', type=int, default=results.MIN_PAIRS)
    p.add_argument('--deadline-s', type=float, default=None, help='start no round that would end after this')
    p.add_argument('--dry-run', action='store_true', help='CPUs and gloo, tiny sizes: proves the harness')
    p.add_argument('--quick', action='store_true',
                   help='entry-points: 64 + 32 images at 160 px, one epoch each: that each trains, not how fast')
    p.add_argument('--lever', help="loop-lever: the GPU-only step with --levers LEVER too (e.g. channels_last=0)")
    p.add_argument('--kit-levers', default='',
                   help="per-gpu, per-gpu-det, parity, entry-points, ckpt-windows (others refuse it): --levers for the "
                        "kit's runs; the series keys name them")
    p.add_argument('--task', choices=[name for name, task in TASKS.items() if not task.masks],
                   help='per-gpu, per-gpu-det: the scripts compared (default detect-dual: train_dual.py | '
                        "ddp_train_dual.py); the segmentation tasks need polygons, which the bench's photographs lack")
    p.add_argument('--window-s', type=float, metavar='W',
                   help='ckpt-windows: seconds a window (default 60: a checkpoint a minute in the windows with one)')
    p.add_argument('--dataset', choices=('photo', 'demo'), default='photo',
                   help="photo: bench/photo_data.py's photographs (needs scikit-image); demo: the kit's flat shapes")
    p.add_argument('--work', default='/tmp/yolov9-ddp-bench', help='trees, datasets, runs, logs')
    p.add_argument('--carry', default=str(KIT / '.bench'), help="bench/prepare_trees.py's packed folder")
    args = p.parse_args()
    refuse_unread_options(p, args)
    if args.gpus is None:
        import torch
        args.gpus = 2 if args.dry_run else torch.cuda.device_count()
    if not args.dry_run and args.gpus < 1:
        raise SystemExit('run_bench.py: no GPU here; use --dry-run on CPUs')
    if args.dataset == 'photo':
        photo_data.photo_sources()  # scikit-image is there, before anything starts
    bench = Bench(args)
    bench.save()
    CALLS[args.call](bench)
    bench.save()
    print(json.dumps(bench.record['targets'], indent=1))


if __name__ == '__main__':
    main()
