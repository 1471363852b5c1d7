"""Launching real multi-process jobs (torchrun, gloo on CPU) in a patched tree, and the probes
(testsupport/probes/probe.py) that report what each rank of a job saw."""
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from testsupport import zygote
from testsupport.cores import check_runs_jobs
from testsupport.trees import TINY_CFG
from yolov9_ddp.demo_data import DemoSpec

TORCHRUN = Path(__file__).resolve().parent / 'torchrun.py'  # torchrun with the grace period set below
PROBE = Path(__file__).resolve().parent / 'probes' / 'probe.py'
NEW_INTERPRETERS = {'YOLOV9_TEST_FORKED': '0'}  # env of a job whose processes are new interpreters, not forked
#   (testsupport/forked.py): for a test that reads a worker's environment from /proc/PID/environ


def free_port() -> int:
    """A port free now, drawn below the kernel's ephemeral range: a port bound as 0 (gloo's connections, the next
    job's) comes from that range, and could take this one before its job binds it (EADDRINUSE). Drawn from the
    system's randomness: pytest-randomly seeds the random module alike in every test."""
    ephemeral_start = int(Path('/proc/sys/net/ipv4/ip_local_port_range').read_text().split()[0])
    while True:
        port = random.SystemRandom().randrange(max(1024, ephemeral_start - 10000), ephemeral_start)
        with socket.socket() as s:
            try:
                s.bind(('127.0.0.1', port))
            except OSError:  # taken: draw again
                continue
            return port


def copy_dataset(data_yaml: Path, dest: Path, labels=True) -> Path:
    """A copy of a demo dataset (images, and labels unless labels=False) with its data.yaml pointing at it."""
    shutil.copytree(data_yaml.parent / 'images', dest / 'images')
    if labels:
        shutil.copytree(data_yaml.parent / 'labels', dest / 'labels', ignore=shutil.ignore_patterns('*.cache'))
    text = data_yaml.read_text().replace(f'path: {data_yaml.parent}', f'path: {dest}')
    assert f'path: {dest}' in text, text
    (dest / 'data.yaml').write_text(text)
    return dest / 'data.yaml'


def job_env(**extra) -> dict:
    """Environment for a job: gloo on loopback, one thread per process (2 cores run several processes), and a
    worker that ignores torchrun's SIGTERM killed after 10 s instead of 30 (testsupport/torchrun.py)."""
    env = {**os.environ, 'GLOO_SOCKET_IFNAME': 'lo', 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1',
           'MPLBACKEND': 'Agg', 'YOLOv5_VERBOSE': 'True', 'TORCH_ELASTIC_SHUTDOWN_TIMEOUT': '10',
           'PYTHONFAULTHANDLER': '1'}  # a process that crashes (SIGABRT, SIGSEGV) prints where it was
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun_cmd(nproc: int, *args, launcher=('--nnodes', '1')) -> list:
    check_runs_jobs(nproc)
    return [sys.executable, TORCHRUN, *launcher, '--nproc_per_node', str(nproc),
            '--master_addr', '127.0.0.1', '--master_port', str(free_port()), *map(str, args)]


def launch_cmd(nproc: int, script, *args) -> list:
    """torchrun for several processes, a plain python process for one."""
    return torchrun_cmd(nproc, script, *args) if nproc > 1 else [sys.executable, *map(str, (script, *args))]


def run(cmd, cwd, timeout=300, env=None, stderr=subprocess.PIPE) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, ...), forked from this process's zygote
    when it can be (testsupport/zygote.py)."""
    return zygote.run(cmd, cwd, env or job_env(), job_env(), timeout, stderr)


def train_args(data_yaml, project, epochs=2, batch=8, imgsz=64, *extra, cfg=TINY_CFG) -> list:
    return ['--data', data_yaml, '--cfg', cfg, '--epochs', epochs, '--batch-size', batch, '--imgsz', imgsz,
            '--device', 'cpu', '--workers', 0, '--project', project, '--name', 'exp', '--noplots', *extra]


# The datasets of the tests of every task (tests/conftest.py task_datasets): 45 training images (not a multiple of
# the batches of 2 ranks), validation sets of 50 and 32. Detection tasks take boxes, segmentation tasks polygons.
TASK_DATASETS = {'boxes': DemoSpec(train=45, val=50, imgsz=64),
                 'polygons': DemoSpec(train=45, val=32, imgsz=64, labels='polygons')}


def labels_of(task: str) -> str:
    from yolov9_ddp.tasks import TASKS
    return 'polygons' if TASKS[task].masks else 'boxes'


def task_cfg(task: str) -> Path:
    """The kit's tiny model of a task (yolov9_ddp.tasks)."""
    from yolov9_ddp.tasks import TASKS
    return TINY_CFG.parent / TASKS[task].demo_cfg


def run_probe(tree, nproc, modes: str, out: Path, args, config=None, timeout=300) -> list:
    """Run testsupport/probes/probe.py MODES under torchrun (nproc > 1) or as one process: [{mode: what rank r
    observed}, for each rank r]."""
    cmd = launch_cmd(nproc, PROBE, modes, out, *args)
    result = run(cmd, tree, timeout, job_env(PROBE_CONFIG=json.dumps(config or {})))
    assert result.returncode == 0, f'probe {modes} x{nproc} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}'
    report = json.loads(out.read_text())
    assert report['world'] == len(report['ranks']) == nproc
    return report['ranks']
