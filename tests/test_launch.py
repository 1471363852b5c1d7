"""`--device` lists (yolov9_ddp.launch): outside torchrun the entry point starts the job itself, one process per listed
device (`cpu,cpu` on CPUs), a torchrun job in all it does; under a launcher, a list that names another number of
devices than its processes is refused in one line."""
import signal
import subprocess
import sys
import time
from argparse import Namespace

import pytest

from testsupport.faults import (FAULTY, completed_run_problems, fault_args, lingering, one_error_line_problems,
                                start_job, wait_for_path)
from testsupport.injected import Fault
from testsupport.jobs import job_env, run, torchrun_cmd
from yolov9_ddp import comm, launch


def test_the_devices_a_list_names_and_the_lists_refused_before_anything_starts(monkeypatch):
    assert comm.listed_devices('0,1, 2') == ['0', '1', '2'] and comm.listed_devices('cuda:0') == ['0']
    assert comm.listed_devices('cpu,cpu') == ['cpu', 'cpu'] and comm.listed_devices('') == []

    def refusal(device, max_restarts=0):
        with pytest.raises(comm.LaunchError) as refused:
            launch.check(Namespace(device=device, max_restarts=max_restarts))
        return str(refused.value)
    monkeypatch.delenv('WORLD_SIZE', raising=False)
    assert refusal('0,cpu') == '--device 0,cpu mixes the CPU and GPUs: name GPUs only, or cpu once per process'
    assert refusal('0', max_restarts=2).startswith('--max-restarts restarts the job a --device list starts')
    assert launch.wanted(Namespace(device='cpu,cpu')) and not launch.wanted(Namespace(device='0'))
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '2')
    assert refusal('0,1,2') == ('--device 0,1,2 names 3 devices, but the launcher started 2 process(es) on this node: '
                                'give it --nproc_per_node 3, or name 2 devices')
    assert refusal('0,1', max_restarts=1).startswith('--max-restarts is for a --device list without torchrun')
    launch.check(Namespace(device='0,1', max_restarts=0))
    assert not launch.wanted(Namespace(device='0,1')), 'under a launcher the job exists already'


@pytest.mark.one_core
def test_a_gpu_list_where_there_is_none_is_refused_in_one_line_before_any_worker_starts(patched_tree, demo_data):
    result = run([sys.executable, 'ddp_train_dual.py', '--device', '0,1', '--data', demo_data], patched_tree,
                 timeout=120)
    assert result.returncode == 1 and 'world size' not in result.stdout, result.stdout + result.stderr
    assert not one_error_line_problems(result.stderr, '--device 0,1 asks for GPUs, but torch cannot use CUDA here'), \
        result.stderr


@pytest.mark.cores
def test_under_torchrun_a_list_of_another_length_than_its_processes_is_refused_in_one_line(patched_tree, demo_data):
    result = run(torchrun_cmd(2, 'ddp_train_dual.py', '--device', 'cpu,cpu,cpu', '--data', demo_data), patched_tree,
                 timeout=120, env=job_env(), stderr=subprocess.STDOUT)
    assert result.returncode != 0 and 'Starting training' not in result.stdout, result.stdout[-3000:]
    assert not one_error_line_problems(result.stdout, '--device cpu,cpu,cpu names 3 devices, but the launcher '
                                                      'started 2 process(es) on this node'), result.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.timed  # it must be restarted and stopped within a minute
@pytest.mark.usefixtures('upstream_importable')
def test_a_list_starts_a_torchrun_job_that_restarts_after_a_failure_and_stops_on_a_signal(patched_tree, demo_data,
                                                                                            tmp_path):
    """`python faulty_train.py --device cpu,cpu --max-restarts 1`: two processes (world size 2); rank 1 killed in
    epoch 1, the job restarts and continues its run; SIGTERM to the starting process mid-epoch 2 stops every rank
    after the same step, exit 143, with --save-on-signal's resumable last.pt, and no process of the job is left. A
    resume starts the run's list again, and the line about its flags comes once."""
    project = tmp_path / 'runs'
    cmd = [sys.executable, FAULTY, *fault_args(demo_data, project, 3), '--device', 'cpu,cpu', '--max-restarts', 1,
           '--save-on-signal']
    faults = [Fault('kill', rank=1, epoch=1, step=2), Fault('mark', rank=0, epoch=2, step=1, sleep=2, attempt=1)]
    job = start_job(list(map(str, cmd)), patched_tree, tmp_path, 'listed', faults)
    wait_for_path(job.records / 'mark-mark', job)
    job.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert job.wait(60) == 128 + signal.SIGTERM, job.output()[-4000:]
    output = job.output()
    assert time.monotonic() - started < 60 and 'world size 2' in output and 'torchrun restart 1: continuing' in output
    assert output.count('ddp_train_dual.py: stopped on SIGTERM; resumable checkpoint written to') == 1, output[-3000:]
    assert lingering(job.marker) == []
    resumed = run([sys.executable, 'ddp_train_dual.py', '--resume', project / 'exp' / 'weights' / 'last.pt',
                   '--batch-size', 8], patched_tree, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert 'world size 2' in resumed.stdout, "the run's own --device list, started again"
    said = resumed.stdout + resumed.stderr
    assert said.count('so these flags are ignored: --batch-size 8') == 1, 'said by rank 0, not by its launcher too'
    assert completed_run_problems(project, 3) == []
