#!/usr/bin/env python3
"""Side-by-side GPU benchmark of upstream's train_dual.py and the kit's ddp_train_dual.py, in one run.

    python bench/run_bench.py --trees .bench --gpus 2 --sections main,ceiling,val --out OUT_DIR
    python bench/run_bench.py --trees .bench --gpus 2 --sections levers,parity --out OUT_DIR

--trees holds two patched copies of the pinned YOLOv9 (made by bench/prepare_trees.py): `upstream` with the
modern-stack patches only (0001-0008, so upstream's own code runs unchanged on today's stack) and `kit` with
the whole series and the kit installed. Every run uses the same generated dataset (4096 images at 640 px by
default, made on the machine), model, global batch, AMP and epoch count; the number of GPUs is a parameter.

Throughput is measured from outside the training process, the same way for both: the moment each epoch's row
lands in results.csv. The first epoch (start-up, cudnn autotuning, worker start) is excluded: img/s is the
second epoch's images over the time between the first and second rows, and the job is stopped there (the
third epoch exists only so that the second is not the final one, which validates). Peak memory per GPU is
sampled with nvidia-smi every 0.2 s. Each section appends its figures to OUT/results.json as it finishes.
"""
import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

KIT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(KIT))

from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset  # noqa: E402

NCCL_SAFETY = {'NCCL_NVLS_ENABLE': '0', 'TORCH_SYMM_MEM_DISABLE_MULTICAST': '1', 'NVSHMEM_DISABLE_NVLS': '1'}
# Each lever of yolov9_ddp/levers.py switched away from its default, one at a time (see YOLOV9_DDP_LEVERS).
LEVER_ABLATIONS = ['cudnn_benchmark=0', 'fused_optimizer=0', 'foreach_ema=0', 'progress_every=1', 'pin_memory=0',
                   'persistent_workers=0', 'bucket_view=0', 'channels_last=1', 'static_graph=1', 'compile=1']


class Bench:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results_file = self.out / 'results.json'
        self.results = json.loads(self.results_file.read_text()) if self.results_file.exists() else {}
        self.work = Path(args.work)
        self.logs = self.work / 'logs'  # full logs stay on the machine; results.json keeps the tails of failed runs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.upstream, self.kit = Path(args.trees).resolve() / 'upstream', Path(args.trees).resolve() / 'kit'
        self.env = {**os.environ, **NCCL_SAFETY, 'PYTHONUNBUFFERED': '1', 'MPLBACKEND': 'Agg'}

    def record(self, section, value):
        self.results[section] = value
        self.results_file.write_text(json.dumps(self.results, indent=1))
        print(f'== {section}: {json.dumps(value)[:1500]}', flush=True)

    # -- data and commands ------------------------------------------------------------------------------------------

    def dataset(self, train, val, imgsz):
        spec = DemoSpec(train=train, val=val, imgsz=imgsz, max_objects=8)
        return ensure_demo_dataset(self.work / f'data-{train}-{val}-{imgsz}', spec, processes=os.cpu_count())

    def kit_workers(self, gpus):
        """Ask the kit for as many workers as it allows: it sizes them from the CPUs per local rank."""
        return os.cpu_count()

    def train_cmd(self, script, gpus, data, cfg, batch_per_gpu, imgsz, epochs, name, extra=(), workers=None):
        a = self.args
        workers = workers or (self.kit_workers(gpus) if script == 'ddp_train_dual.py' else a.workers)
        common = ['--data', data, '--cfg', cfg, '--hyp', 'data/hyps/hyp.scratch-high.yaml', '--epochs', epochs,
                  '--batch-size', batch_per_gpu * gpus, '--imgsz', imgsz, '--workers', workers,
                  '--device', ','.join(str(i) for i in range(gpus)) if a.device != 'cpu' else 'cpu',
                  '--project', self.work / 'runs', '--name', name, '--exist-ok', '--noplots', *extra]
        launcher = [sys.executable] if gpus == 1 else \
            [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', gpus]
        return [str(x) for x in [*launcher, script, *common]]

    # -- measuring a training run -------------------------------------------------------------------------------------

    def measure(self, name, cmd, cwd, images, rows_needed=2, env=None, timeout=400):
        """Run until results.csv has rows_needed rows; returns timings, peak memory per GPU and the log tail."""
        csv_path = self.work / 'runs' / name / 'results.csv'
        csv_path.unlink(missing_ok=True)
        sampler = MemorySampler() if self.args.device != 'cpu' else None
        log = open(self.logs / f'{name}.log', 'w')
        started = time.time()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        stamps = []
        try:
            while len(stamps) < rows_needed:
                rows = count_rows(csv_path)
                stamps += [time.time()] * (rows - len(stamps))
                if proc.poll() is not None and len(stamps) < rows_needed:
                    if count_rows(csv_path) >= rows_needed:
                        continue
                    raise RuntimeError(f'{name} exited with {proc.returncode} after {len(stamps)} epochs: '
                                       f'{log_tail(self.logs / f"{name}.log")}')
                if time.time() - started > timeout:
                    raise RuntimeError(f'{name} timed out after {len(stamps)} epochs: '
                                       f'{log_tail(self.logs / f"{name}.log")}')
                time.sleep(0.05)
        finally:
            stop(proc, marker=str(self.work / 'runs' / name))
            log.close()
            peaks = sampler.stop() if sampler else {}
        seconds = stamps[-1] - stamps[-2]
        result = {'img_per_s': round(images / seconds, 1), 'epoch_s': round(seconds, 2),
                  'first_epoch_end_s': round(stamps[0] - started, 1), 'peak_mem_mib': peaks,
                  'kit_epoch_log': [line.strip() for line in (self.logs / f'{name}.log').read_text(errors='replace')
                                    .splitlines() if line.startswith('epoch ')][-2:]}
        print(f'   {name}: {result}', flush=True)
        return result

    # -- sections ---------------------------------------------------------------------------------------------------

    def main_section(self):
        a, gpus = self.args, self.args.gpus
        data = self.dataset(a.images, a.val_images, a.data_imgsz)
        runs = {}
        plan = [('upstream', self.upstream, 'train_dual.py', n, None) for n in sorted({1, gpus})]
        plan += [('kit', self.kit, 'ddp_train_dual.py', n, None) for n in sorted({1, gpus})]
        for label, tree, script, n, workers in plan:
            name = f'{label}-{n}gpu' + (f'-w{workers}' if workers else '')
            cmd = self.train_cmd(script, n, data, a.cfg, a.batch_per_gpu, a.imgsz, 3, name, ['--noval'], workers)
            runs[name] = {'gpus': n, 'global_batch': a.batch_per_gpu * n, 'command': ' '.join(cmd)}
            try:
                runs[name].update(self.measure(name, cmd, tree, a.images))
                runs[name]['per_gpu_img_per_s'] = round(runs[name]['img_per_s'] / n, 1)
            except RuntimeError as e:  # keep measuring the others
                runs[name]['error'] = str(e)
            self.record('main', runs)

    def ceiling_section(self):
        cmd = [sys.executable, str(KIT / 'bench' / 'gpu_step.py'), '--cfg', self.args.cfg, '--batch',
               str(self.args.batch_per_gpu), '--imgsz', str(self.args.imgsz)]
        result = subprocess.run(cmd, cwd=self.kit, env=self.env, capture_output=True, text=True, timeout=300)
        (self.logs / 'ceiling.log').write_text(result.stdout + result.stderr)
        if result.returncode:
            raise RuntimeError(log_tail(self.logs / 'ceiling.log'))
        self.record('ceiling', json.loads(result.stdout.strip().splitlines()[-1]))

    def val_section(self):
        a = self.args
        data = self.dataset(a.images, a.val_images, a.data_imgsz)
        timings = {}
        for n in sorted({1, a.gpus}):
            out = self.logs / f'val-{n}gpu.json'
            args = [KIT / 'bench' / 'val_time.py', out, '--data', data, '--cfg', a.cfg, '--imgsz', a.imgsz,
                    '--batch-size', a.batch_per_gpu * n, '--workers', a.workers, '--device',
                    ','.join(str(i) for i in range(n)) if a.device != 'cpu' else 'cpu',
                    '--project', self.work / 'runs', '--name', f'val-{n}', '--exist-ok', '--noplots']
            launcher = [sys.executable] if n == 1 else \
                [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', n]
            result = subprocess.run([str(x) for x in [*launcher, *args]], cwd=self.kit, env=self.env,
                                    capture_output=True, text=True, timeout=400)
            (self.logs / f'val-{n}gpu.log').write_text(result.stdout + result.stderr)
            if result.returncode:
                raise RuntimeError(log_tail(self.logs / f'val-{n}gpu.log'))
            timings[f'{n}gpu'] = json.loads(out.read_text())
        self.record('validation', timings)

    def levers_section(self):
        a = self.args
        data = self.dataset(a.lever_images, a.val_images, a.data_imgsz)
        runs = {}
        for ablation in ['defaults', f'workers={a.workers}', *LEVER_ABLATIONS]:
            name = 'lever-' + ablation.replace('=', '-')
            extra = ['--noval']
            env = dict(self.env)
            workers = int(ablation.split('=')[1]) if ablation.startswith('workers=') else None
            if ablation != 'defaults' and not workers:
                env['YOLOV9_DDP_LEVERS'] = ablation
            cmd = self.train_cmd('ddp_train_dual.py', a.gpus, data, a.cfg, a.batch_per_gpu, a.imgsz, 3, name, extra,
                                 workers)
            try:
                runs[ablation] = self.measure(name, cmd, self.kit, a.lever_images, env=env, timeout=240)
            except RuntimeError as e:  # keep measuring the others
                runs[ablation] = {'error': str(e)}
            self.record('levers', runs)

    def parity_section(self):
        a = self.args
        data = self.dataset(a.images, a.val_images, a.parity_imgsz)
        tiny = str(KIT / 'yolov9_ddp' / 'models' / 'tiny-dual.yaml')
        runs = {}
        for n in sorted({1, a.gpus}):
            name = f'parity-{n}gpu'
            cmd = self.train_cmd('ddp_train_dual.py', n, data, tiny, a.parity_batch // n, a.parity_imgsz,
                                 a.parity_epochs, name)
            result = subprocess.run(cmd, cwd=self.kit, env=self.env, capture_output=True, text=True, timeout=500)
            (self.logs / f'{name}.log').write_text(result.stdout + result.stderr)
            final = [line for line in (result.stdout + result.stderr).splitlines() if 'Final:' in line]
            runs[name] = {'gpus': n, 'global_batch': a.parity_batch, 'epochs': a.parity_epochs,
                          'returncode': result.returncode, 'final': final[-1] if final else None,
                          'best_row': best_row(self.work / 'runs' / name / 'results.csv')}
            self.record('parity', runs)


class MemorySampler:
    """Peak memory.used per GPU, from nvidia-smi every 0.2 s."""

    def __init__(self):
        self.peaks, self.proc = {}, subprocess.Popen(
            ['nvidia-smi', '--query-gpu=index,memory.used', '--format=csv,noheader,nounits', '-lms', '200'],
            stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self):
        for line in self.proc.stdout:
            index, used = (int(x) for x in line.split(','))
            self.peaks[index] = max(self.peaks.get(index, 0), used)

    def stop(self):
        self.proc.terminate()
        self.thread.join(timeout=2)
        return self.peaks


def log_tail(path: Path) -> str:
    text = path.read_text(errors='replace').replace('\r', '\n') if path.exists() else ''
    return '\n'.join(line for line in text.splitlines() if line.strip() and '%|' not in line)[-4000:]


def count_rows(path: Path) -> int:
    try:
        return max(0, len(path.read_text().strip().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def best_row(path: Path):
    with open(path) as f:
        rows = [{k.strip(): v.strip() for k, v in row.items()} for row in csv.DictReader(f)]
    return max(rows, key=lambda r: float(r['metrics/mAP_0.5:0.95'])) if rows else None


def stop(proc, marker):
    """Stop a run: SIGTERM to the launcher (torchrun passes it on), then SIGKILL whatever still carries the marker."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    subprocess.run(['pkill', '-9', '-f', marker], capture_output=True)
    time.sleep(2)  # let the GPUs' memory drain before the next run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--trees', default=str(KIT / '.bench'))
    p.add_argument('--out', required=True)
    p.add_argument('--work', default='/tmp/yolov9-ddp-bench')
    p.add_argument('--sections', default='main,ceiling,val,levers,parity')
    p.add_argument('--gpus', type=int, default=2)
    p.add_argument('--device', default='cuda', help="'cpu' only to smoke-test the harness")
    p.add_argument('--cfg', default='models/detect/yolov9-s.yaml')
    p.add_argument('--images', type=int, default=4096)
    p.add_argument('--val-images', type=int, default=1000)
    p.add_argument('--lever-images', type=int, default=1024)
    p.add_argument('--data-imgsz', type=int, default=640)
    p.add_argument('--imgsz', type=int, default=640)
    p.add_argument('--batch-per-gpu', type=int, default=32)
    p.add_argument('--workers', type=int, default=8, help="upstream's loader workers per process (FINDINGS.md)")
    p.add_argument('--parity-imgsz', type=int, default=256)
    p.add_argument('--parity-batch', type=int, default=64)
    p.add_argument('--parity-epochs', type=int, default=6)
    args = p.parse_args()
    bench = Bench(args)
    sections = {'main': bench.main_section, 'ceiling': bench.ceiling_section, 'val': bench.val_section,
                'levers': bench.levers_section, 'parity': bench.parity_section}
    bench.results.setdefault('runs', []).append({'sections': args.sections, 'started': time.strftime('%F %T'),
                                                 'command': ' '.join(sys.argv)})
    for section in args.sections.split(','):
        try:
            sections[section]()
        except Exception as e:  # keep the other sections' figures
            bench.record(f'{section}_error', repr(e))


if __name__ == '__main__':
    main()
