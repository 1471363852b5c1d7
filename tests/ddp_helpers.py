"""Launching real multi-process jobs (torchrun, gloo on CPU) in a patched tree, for the DDP tests."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

KIT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / 'ddp_probes' / 'probe.py'
TINY_CFG = KIT / 'yolov9_ddp' / 'models' / 'tiny-dual.yaml'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def job_env(**extra) -> dict:
    """Environment for a job: gloo on loopback, one thread per process (2 cores run several processes)."""
    env = {**os.environ, 'GLOO_SOCKET_IFNAME': 'lo', 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1',
           'MPLBACKEND': 'Agg', 'YOLOv5_VERBOSE': 'True'}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun_cmd(nproc: int, *args, launcher=('--nnodes', '1')) -> list:
    return [sys.executable, '-m', 'torch.distributed.run', *launcher, '--nproc_per_node', str(nproc),
            '--master_addr', '127.0.0.1', '--master_port', str(free_port()), *map(str, args)]


def run(cmd, cwd, timeout=300, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env or job_env(), capture_output=True, text=True, timeout=timeout)


def train_args(data_yaml, project, epochs=2, batch=8, imgsz=64, *extra) -> list:
    return ['--data', data_yaml, '--cfg', TINY_CFG, '--epochs', epochs, '--batch-size', batch, '--imgsz', imgsz,
            '--device', 'cpu', '--workers', 0, '--project', project, '--name', 'exp', '--noplots', *extra]


def run_probe(tree, nproc, mode, out: Path, args, config=None, timeout=300):
    """Run tests/ddp_probes/probe.py MODE under torchrun (nproc > 1) or as one process; returns its JSON."""
    script = [PROBE, mode, out, *args]
    cmd = torchrun_cmd(nproc, *script) if nproc > 1 else [sys.executable, *map(str, script)]
    result = run(cmd, tree, timeout, job_env(PROBE_CONFIG=json.dumps(config or {})))
    assert result.returncode == 0, f'probe {mode} x{nproc} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}'
    return json.loads(out.read_text())
