"""A real single-node Slurm cluster that a test starts and always stops (tests/test_slurm.py).

Debian's packages are installed when missing (CI runs as root with Debian's registry reachable). Everything the
cluster writes lives in one temporary folder: a munged of its own (own key and socket), slurm.conf (found by the
Slurm commands through SLURM_CONF), state, spool and logs. Its ports are free ones and munged's socket is private,
so it meets no other cluster on the machine. The node has two fake GPUs (gres backed by /dev/null and /dev/zero):
the job scripts' GPU arithmetic runs as on a GPU node while the training itself uses --device cpu.

Two settings keep the tests fast: AuthInfo cred_expire=5 and SchedulerParameters bf_interval=1,sched_interval=1 start a
requeued job again within seconds instead of two minutes. Slurm checks time limits, and sends --signal warnings,
only every 30 s: a test cannot choose the moment of a time-limit warning, so its job holds its first start in
training until the warning comes (held_first_start()).
"""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from testsupport.faults import FAULTY, completed_run_problems, lingering, results_epochs
from testsupport.jobs import free_port
from testsupport.injected import Fault, to_env
from testsupport.trees import KIT, TINY_CFG, cache_dir, file_lock

PACKAGES = ('slurmctld', 'slurmd', 'slurm-client', 'munge')
DAEMONS = ('munged', 'slurmctld', 'slurmd')
SBIN_PATH = os.pathsep.join([os.environ.get('PATH', ''), '/usr/sbin', '/sbin'])  # daemons live in sbin
READY_DEADLINE_S = 60
STOP_DEADLINE_S = 90  # a job that ignores SIGTERM is killed after KillWait (30 s)


class SlurmError(AssertionError):
    """Slurm could not be installed, started or asked; the message carries its own words and logs."""


def slurm_commands_missing() -> list:
    return [name for name in (*DAEMONS, 'sbatch', 'scontrol', 'squeue', 'scancel', 'sinfo')
            if not shutil.which(name, path=SBIN_PATH)]


def ensure_slurm_installed():
    """apt-get install the packages when a command is missing; `apt-get update` first only if that fails."""
    with file_lock(cache_dir() / '.slurm-install.lock'):  # two test processes must not run dpkg at once
        if not slurm_commands_missing():
            return
        install = ['apt-get', 'install', '-y', '--no-install-recommends', *PACKAGES]
        env = {**os.environ, 'DEBIAN_FRONTEND': 'noninteractive'}
        result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
        if result.returncode:
            subprocess.run(['apt-get', 'update'], capture_output=True, text=True, env=env, timeout=600)
            result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
        missing = slurm_commands_missing()
        if result.returncode or missing:
            raise SlurmError(f'could not install Slurm with `{" ".join(install)}` (exit {result.returncode}; '
                             f'missing {missing}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}')


def slurm_conf(root: Path, ports: tuple, cpus: int, gpus: int) -> str:
    ctld_port, slurmd_port = ports
    return '\n'.join([
        'ClusterName=yolov9ddp',
        'SlurmctldHost=localhost',
        f'SlurmctldPort={ctld_port}',
        f'SlurmdPort={slurmd_port}',
        'SlurmUser=root',
        'SlurmdUser=root',
        'AuthType=auth/munge',
        'CredType=cred/munge',
        f'AuthInfo=socket={root}/munge/munge.sock,cred_expire=5',
        f'StateSaveLocation={root}/state',
        f'SlurmdSpoolDir={root}/spool',
        f'SlurmctldPidFile={root}/slurmctld.pid',
        f'SlurmdPidFile={root}/slurmd.pid',
        f'SlurmctldLogFile={root}/slurmctld.log',
        f'SlurmdLogFile={root}/slurmd.log',
        'ProctrackType=proctrack/linuxproc',  # no cgroups, no systemd: works in a container
        'TaskPlugin=task/none',
        'SelectType=select/cons_tres',
        'SelectTypeParameters=CR_CPU',
        'SchedulerParameters=bf_interval=1,sched_interval=1',
        'AccountingStorageType=accounting_storage/none',
        'JobAcctGatherType=jobacct_gather/none',
        'JobCompType=jobcomp/none',
        'MpiDefault=none',
        'ReturnToService=2',
        'KillWait=30',  # Slurm's default: SIGKILL this long after the SIGTERM that ends a job
        'GresTypes=gpu',
        f'NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} Gres=gpu:{gpus} State=UNKNOWN',
        'PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP',
        ''])


FAKE_GPU_DEVICES = ('/dev/null', '/dev/zero')  # gres needs character devices; Slurm only counts and numbers them


class Cluster:
    """munged, slurmctld and slurmd in the foreground as our children, configured under a private folder."""

    def __init__(self, root: Path, cpus=2):
        self.root, self.cpus = Path(root), cpus
        self.conf = self.root / 'slurm.conf'
        self.daemons = {}  # name -> Popen

    @property
    def env(self) -> dict:
        return {'SLURM_CONF': str(self.conf)}

    def start(self):
        ensure_slurm_installed()
        munge = self.root / 'munge'
        munge.mkdir(parents=True)
        munge.chmod(0o755)  # munged wants every folder above its socket searchable by all, writable by its owner
        key = munge / 'munge.key'
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for folder in ('state', 'spool'):
            (self.root / folder).mkdir()
        self.conf.write_text(slurm_conf(self.root, (free_port(), free_port()), self.cpus, len(FAKE_GPU_DEVICES)))
        (self.root / 'gres.conf').write_text(''.join(f'NodeName=localhost Name=gpu File={device}\n'
                                                     for device in FAKE_GPU_DEVICES))
        self.launch('munged', '--foreground', f'--socket={munge}/munge.sock', f'--key-file={key}',
                    f'--pid-file={munge}/munged.pid', f'--log-file={munge}/munged.log',
                    f'--seed-file={munge}/munged.seed')
        self.wait_for(lambda: (munge / 'munge.sock').exists(), READY_DEADLINE_S, 'munged to open its socket')
        self.launch('slurmctld', '-D', '-f', self.conf)
        self.launch('slurmd', '-D', '-f', self.conf, '-N', 'localhost')
        self.wait_for(lambda: self.node_state() == 'idle', READY_DEADLINE_S, 'the node to be idle')

    def launch(self, name: str, *args):
        log = open(self.root / f'{name}.out', 'w')
        self.daemons[name] = subprocess.Popen([shutil.which(name, path=SBIN_PATH), *map(str, args)], stdout=log,
                                              stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                              start_new_session=True)
        log.close()

    def wait_for(self, ready, deadline_s: float, what: str):
        deadline = time.monotonic() + deadline_s
        while not ready():
            dead = [name for name, proc in self.daemons.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SlurmError(f'gave up waiting for {what}' + (f'; {dead} exited' if dead else '') +
                                 f'\n{self.logs()}')
            time.sleep(0.2)

    def logs(self, lines=15) -> str:
        parts = []
        for path in sorted(self.root.glob('*.out')) + sorted(self.root.glob('*.log')):
            tail = path.read_text(errors='replace').splitlines()[-lines:]
            parts.append(f'--- {path.name}\n' + '\n'.join(tail))
        return '\n'.join(parts)

    # -- asking Slurm ------------------------------------------------------------------------------------------

    def command(self, *args, check=True, env=None, cwd=None) -> str:
        try:
            result = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=60, cwd=cwd,
                                    env={**(env or os.environ), **self.env})
        except subprocess.TimeoutExpired as e:
            raise SlurmError(f'{" ".join(map(str, args))} did not answer within 60 s\n{self.logs()}') from e
        if check and result.returncode:
            raise SlurmError(f'{" ".join(map(str, args))} failed (exit {result.returncode}): '
                             f'{result.stderr.strip()}\n{self.logs()}')
        return result.stdout

    def node_state(self) -> str:
        return self.command('sinfo', '--noheader', '--format=%T', check=False).strip()

    def submit(self, script: Path, *args, options=(), cwd: Path, env: dict) -> str:
        """sbatch [options] script [args]: the job id."""
        return self.command('sbatch', '--parsable', *options, script, *args, env=env, cwd=cwd).strip().split(';')[0]

    def job(self, job_id: str) -> dict:
        """scontrol's fields of a job (JobState, Restarts, ExitCode, ...); {} once Slurm has forgotten it."""
        line = self.command('scontrol', '--oneliner', 'show', 'job', job_id, check=False).strip()
        return dict(re.findall(r'(\w+)=(\S*)', line))

    def active_jobs(self) -> list:
        return self.command('squeue', '--noheader', '--format=%i', check=False).split()

    # -- stopping ------------------------------------------------------------------------------------------------

    def stop(self):
        """Cancel every job and wait until none is left (a job outlives the daemons), then end the daemons."""
        problems = []
        controller = self.daemons.get('slurmctld')
        try:
            if controller is not None and controller.poll() is None:  # without a controller no job started
                problems += self.cancel_every_job()
        finally:
            problems += self.end_daemons()
        if problems:
            raise SlurmError('; '.join(problems) + f'\n{self.logs()}')

    def cancel_every_job(self) -> list:
        jobs = self.active_jobs()
        if jobs:
            self.command('scancel', *jobs, check=False)
        deadline = time.monotonic() + STOP_DEADLINE_S
        while self.active_jobs():
            if time.monotonic() > deadline:
                return [f'jobs {self.active_jobs()} still there {STOP_DEADLINE_S} s after scancel']
            time.sleep(0.5)
        return []

    def end_daemons(self) -> list:
        problems = []
        for name in reversed(DAEMONS):  # slurmd, slurmctld, then munged, which both need
            proc = self.daemons.get(name)
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session (start_new_session): only the daemon
                proc.wait()
                problems.append(f'{name} ignored SIGTERM; killed it')
        return problems


@contextlib.contextmanager
def running_cluster():
    """A started Cluster under a fresh folder of /tmp (pytest's folders are private, munged refuses them);
    always stopped and removed afterwards, also when the body fails."""
    root = Path(tempfile.mkdtemp(prefix='yolov9-ddp-slurm-'))
    root.chmod(0o755)
    cluster = Cluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)


# -- training jobs of the kit's job scripts (slurm/*.sbatch) --------------------------------------------------------

SCRIPTS = KIT / 'slurm'
# sbatch options that fit the scripts to the test node (2 CPUs, 2 fake GPUs) in place of their 8-GPU defaults;
# the multi-node script runs its 2 agents as 2 tasks on the one node
FITTING_OPTIONS = {
    'single-node.sbatch': ('--gpus-per-node=2', '--cpus-per-gpu=1'),
    'multi-node.sbatch': ('--nodes=1', '--ntasks-per-node=2', '--gpus-per-task=1', '--cpus-per-gpu=1'),
}
ENDED_STATES = ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL', 'PREEMPTED', 'OUT_OF_MEMORY',
                'BOOT_FAIL', 'DEADLINE')
STOPPED = 'ddp_train_dual.py: stopped on SIGTERM; resumable checkpoint written to {last}'
REQUEUEING = 'job {job}: training stopped on a signal (exit 1); requeueing it to continue'
REQUEUED_ANYHOW = 'requeueing it to continue its run'  # also where the launcher ended by the signal (exit 143)
RESUMING = re.compile(r'resuming epoch (\d+) at step (\d+) of \d+ from (\S+)')


def training_flags(data: Path, project: Path, epochs: int) -> list:
    """The flags after the script name: the tiny model on the demo data, 2 images per step over the processes,
    CPU processes (gloo), no loader workers; no --name, so the script's own run name (yolov9-ddp-JOBID) is used."""
    return ['--data', data, '--cfg', TINY_CFG, '--epochs', epochs, '--batch-size', 2, '--imgsz', 64,
            '--device', 'cpu', '--workers', 0, '--project', project, '--noplots']


def job_environment(cluster: Cluster, env: dict, first_on_path: Path = None) -> dict:
    """The environment sbatch passes on to the job: env (offline), this Python's environment first on PATH (its
    torchrun, as an activated virtual environment gives; first_on_path, if given, before it), gloo on loopback, and
    the cluster's SLURM_CONF."""
    path = [*([first_on_path] if first_on_path else []), Path(sys.executable).parent, env.get('PATH', os.defpath)]
    return {**env, 'PATH': os.pathsep.join(map(str, path)), 'GLOO_SOCKET_IFNAME': 'lo', **cluster.env}


def slowed_launcher(folder: Path, name: str, started: Path) -> Path:
    """folder, holding a `name` (srun, torchrun) for the front of a job's PATH that touches started, waits 3 s
    and runs the real one: a signal sent once started exists comes while the launcher starts."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / name
    wrapper.write_text(f'#!/bin/sh\ntouch {started}\nsleep 3\nPATH="${{PATH#*{os.pathsep}}}" exec {name} "$@"\n')
    wrapper.chmod(0o755)
    return folder


def held_first_start(folder: Path, hold_s: float) -> tuple:
    """(folder for the front of a job's PATH, its environment) that make the single-node script's first start train
    with testsupport/probes/faulty_train.py, which holds rank 0 at step 1 of its second epoch (epoch 1) until a
    signal comes, for hold_s at most; a requeued start (SLURM_RESTART_COUNT > 0) trains as usual. So the first start is
    still training when a warning comes whose moment Slurm chooses, however fast this machine runs."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / 'torchrun'
    fault = to_env(Fault('hold', epoch=1, step=1, sleep=hold_s))
    wrapper.write_text(f'#!/bin/sh\n[ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] && export FAULT=\'{fault}\'\n'
                       f'PATH="${{PATH#*{os.pathsep}}}" exec torchrun "$@"\n')
    wrapper.chmod(0o755)
    return folder, {'YOLOV9_DDP_ENTRY': str(FAULTY)}


@dataclass
class SlurmJob:
    cluster: Cluster
    id: str
    log: Path
    project: Path
    workdir: Path

    @property
    def run_dir(self) -> Path:
        return self.project / f'yolov9-ddp-{self.id}'  # the scripts' default NAME: JOBNAME-JOBID

    def output(self) -> str:
        return self.log.read_text(errors='replace') if self.log.exists() else ''

    def fields(self) -> dict:
        return self.cluster.job(self.id)

    def wait_for(self, ready, deadline_s: float, what: str, until_ended=False) -> dict:
        """Poll until ready(fields) holds, fields being the job's; the job ending first (unless until_ended), or the
        deadline passing, fails, and the job is cancelled. The job's fields then."""
        deadline = time.monotonic() + deadline_s
        while True:
            fields = self.fields()
            if ready(fields):
                return fields
            ended = fields.get('JobState') in ENDED_STATES and not until_ended
            if ended or time.monotonic() > deadline:
                self.cluster.command('scancel', self.id, check=False)
                raise SlurmError(f'job {self.id} ({fields.get("JobState")}, restarts {fields.get("Restarts")}) did '
                                 f'not {what} within {deadline_s:.0f} s; cancelled it:\n{self.output()[-4000:]}')
            time.sleep(0.2)

    def wait_for_epochs(self, count: int, deadline_s: float):
        self.wait_for(lambda _: len(results_epochs(self.run_dir)) >= count, deadline_s, f'train {count} epoch(s)')

    def wait_until_ended(self, deadline_s: float) -> dict:
        return self.wait_for(lambda fields: fields.get('JobState') in ENDED_STATES, deadline_s, 'end', True)


def submit_training(cluster: Cluster, script: str, tree: Path, workdir: Path, data: Path, epochs: int, env: dict,
                    options=(), first_on_path: Path = None) -> SlurmJob:
    """sbatch the kit's job script from the patched tree (the job runs there), with its log in workdir."""
    project = workdir / 'runs'
    workdir.mkdir(parents=True, exist_ok=True)  # Slurm fails a job whose log folder is missing
    job_id = cluster.submit(SCRIPTS / script, *training_flags(data, project, epochs),
                            options=(*FITTING_OPTIONS[script], f'--output={workdir}/%x-%j.out', *options),
                            cwd=tree, env=job_environment(cluster, env, first_on_path))
    return SlurmJob(cluster, job_id, workdir / f'yolov9-ddp-{job_id}.out', project, workdir)


def completed_after_stops_problems(job: SlurmJob, fields: dict, epochs: int, stops: int, late_stops=0,
                                   launch_stops=0) -> list:
    """Why a job stopped by a signal `stops` times (0: never) did not end as one completed run: COMPLETED after as
    many requeues, every start appended to the one log, each stop writing a resumable last.pt that the next start
    resumed in the same folder, every epoch in results.csv, a loadable last.pt, no process left behind.

    late_stops: a signal that came after the last training step still requeues the job once (torchrun exits 1
    whenever it forwards a signal); that start finds the run finished and ends at once.
    launch_stops: a signal that came while the launcher started, before the first start trained, requeues the job
    too (the launcher, not the training, ends by it); that start leaves no run behind, and the next one begins it."""
    output, last = job.output(), job.run_dir / 'weights' / 'last.pt'
    requeues = stops + late_stops + launch_stops
    problems = []
    if (fields.get('JobState'), fields.get('ExitCode'), fields.get('Restarts')) != ('COMPLETED', '0:0', str(requeues)):
        problems.append(f'job state {fields.get("JobState")}, exit code {fields.get("ExitCode")}, '
                        f'restarts {fields.get("Restarts")}; expected COMPLETED, 0:0, {requeues}')
    starts = re.findall(rf'^job {job.id} start (\d+) ', output, re.MULTILINE)
    if starts != [str(n) for n in range(1, requeues + 2)]:
        problems.append(f'the log shows starts {starts}, not 1..{requeues + 1} appended in order')
    expected = {STOPPED.format(last=last): stops, REQUEUEING.format(job=job.id): stops + late_stops,
                REQUEUED_ANYHOW: requeues, f'--auto-resume: continuing {job.run_dir}': stops + late_stops,
                'Starting training': stops + 1,
                f'training in {job.run_dir} already finished': late_stops}
    problems += [f'"{line}" appears {output.count(line)} times, not {count}'
                 for line, count in expected.items() if output.count(line) != count]
    resumed = RESUMING.findall(output)
    if [path for _, _, path in resumed] != [str(last)] * stops:
        problems.append(f'resumed from {resumed}, expected {stops} resume(s) from {last}')
    for unexpected in ('KeyboardInterrupt', 'was requeued (SLURM_RESTART_COUNT', 'not requeued'):
        if unexpected in output:
            problems.append(f'"{unexpected}" in the log')
    problems += completed_run_problems(job.project, epochs)
    left = lingering(str(job.workdir))
    if left or job.cluster.active_jobs():
        problems.append(f'left behind: processes {left}, jobs {job.cluster.active_jobs()}')
    return problems


def resumable_checkpoint_at_requeue(job: SlurmJob, deadline_s: float) -> dict:
    """Once the job script says it requeues the job (its training has ended, the next start has not begun), the
    checkpoint the stop wrote: it must be resumable. Its epoch and EMA update count, for the test to compare."""
    from yolov9_ddp import checkpoints, files
    job.wait_for(lambda _: REQUEUEING.format(job=job.id) in job.output(), deadline_s, 'requeue itself')
    last = job.run_dir / 'weights' / 'last.pt'
    saved = checkpoints.load_checkpoint(last, require_resume_state=True)
    previous = checkpoints.load_checkpoint(files.previous_path(last))
    return {'epoch': saved['epoch'], 'updates': saved['updates'], 'previous_epoch': previous['epoch'],
            'previous_updates': previous['updates'], 'rows': results_epochs(job.run_dir)}
