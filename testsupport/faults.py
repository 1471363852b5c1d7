"""Fault scenarios: jobs of the fault-injection driver testsupport/probes/faulty_train.py and what they left
behind. tests/test_faults.py asserts on them in detail; bench/reliability.py counts them."""
import csv
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from testsupport import zygote
from testsupport.injected import Fault, to_env
from testsupport.imagecache import parent_of
from testsupport.jobs import TORCHRUN, job_env, launch_cmd, run, task_cfg, torchrun_cmd, train_args
from testsupport.trees import TINY_CFG

DUAL = 'detect-dual'  # the task of ddp_train_dual.py (yolov9_ddp.tasks), the default of every scenario


FAULTY = Path(__file__).resolve().parent / 'probes' / 'faulty_train.py'
FAULT_EPOCHS = 3  # epochs of a fault scenario: a fault in epoch 1 leaves an epoch before it and one after
STOP_DEADLINE_S = 60  # a signalled job must be gone within this
MARK_SLOW = Fault('mark', rank=0, epoch=1, step=1, sleep=2)  # rank 0 says "mid-epoch 1" and lingers there


@dataclass
class Job:
    """A launch running in the background: output in a file, faulty_train.py's records in a folder."""
    proc: subprocess.Popen
    log: Path
    records: Path
    marker: str  # a path unique to this job, on the command line of every process the job starts
    started: float
    returncode: int = None
    wall: float = None

    def output(self) -> str:
        return self.log.read_text(errors='replace') if self.log.exists() else ''

    def wait(self, timeout: float) -> int:
        """The exit status; a job still running after timeout seconds is killed with all its processes and
        AssertionError raised (no test waits for ever)."""
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_processes_mentioning(self.marker)
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f'the job did not end within {timeout:.0f} s; killed it\n{self.output()[-4000:]}')
        self.wall = time.monotonic() - self.started
        return self.returncode

    def events(self, kind=None) -> list:
        return fault_events(self.records, kind)


def fault_events(records: Path, kind=None) -> list:
    """faulty_train.py's records (start / fired / exit), oldest first."""
    events = []
    for path in Path(records).glob('*.json'):
        event = json.loads(path.read_text())
        if kind is None or event['kind'] == kind:
            events.append(event)
    return sorted(events, key=lambda e: e['time'])


def start_job(cmd, tree, workdir: Path, name: str, fault=(), **env) -> Job:
    """Start cmd in the tree, in a session of its own, with FAULT (a Fault or a list of them, testsupport.injected)
    and env set; output goes to workdir/NAME.log and faulty_train.py's records to workdir/records-NAME (FAULT_DIR)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log, records = workdir / f'{name}.log', workdir / f'records-{name}'
    with open(log, 'w') as out:
        proc = zygote.popen(cmd, tree, job_env(FAULT=to_env(fault), FAULT_DIR=records, **env), job_env(), out,
                            subprocess.STDOUT, start_new_session=True)
    return Job(proc, log, records, f'{workdir}/', time.monotonic())


def faulty_torchrun(nproc, args, max_restarts=0) -> list:
    return torchrun_cmd(nproc, '--max-restarts', max_restarts, FAULTY, *args)


def node_cmd(nnodes: int, endpoint: str, run_id: str, *args) -> list:
    """One node's torchrun agent of a multi-node job (one process per node), c10d rendezvous at endpoint."""
    return [sys.executable, TORCHRUN, '--nnodes', nnodes, '--nproc_per_node', 1,
            '--rdzv-backend', 'c10d', '--rdzv-endpoint', endpoint, '--rdzv-id', run_id, *args]


def processes_mentioning(text: str) -> list:
    """Pids of the processes (other than this one) whose command line contains text."""
    pids = []
    for entry in Path('/proc').iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / 'cmdline').read_bytes().replace(b'\0', b' ').decode(errors='replace')
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def children_of(pid: int, started_with: str = None) -> list:
    """Pids of pid's children (a torchrun agent's: its workers; their loader workers are not), or of those whose
    environment at their start held started_with ('RANK=1'): /proc/PID/environ shows it for a new interpreter, not
    for a forked process (a job with jobs.NEW_INTERPRETERS has only new interpreters)."""
    children = []
    for entry in Path('/proc').iterdir():
        if not entry.name.isdigit() or parent_of(int(entry.name)) != pid:
            continue
        try:
            environ = (entry / 'environ').read_bytes().split(b'\0')
        except OSError:
            continue
        if started_with is None or started_with.encode() in environ:
            children.append(int(entry.name))
    return children


def kill_processes_mentioning(text: str):
    for pid in processes_mentioning(text):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def wait_until(done, what: str, job: Job, timeout: float = 240):
    """Poll done() while job runs: fail if the job ends first, or (its processes killed) after timeout seconds.
    what: the awaited moment, for the failure ('mark-mark to appear')."""
    deadline = time.monotonic() + timeout
    while not done():
        if job.proc.poll() is not None:
            raise AssertionError(f'the job ended (exit {job.proc.returncode}) while waiting for {what}:\n'
                                 f'{job.output()[-4000:]}')
        if time.monotonic() > deadline:
            kill_processes_mentioning(job.marker)
            raise AssertionError(f'waited {timeout} s for {what} in vain:\n{job.output()[-4000:]}')
        time.sleep(0.05)


def wait_for_path(path: Path, job: Job, timeout=240):
    wait_until(path.exists, f'{path.name} to appear', job, timeout)


def run_folders(project: Path) -> list:
    return sorted(p for p in Path(project).iterdir() if p.is_dir()) if Path(project).is_dir() else []


def results_epochs(run_dir: Path) -> list:
    """The epoch column of results.csv, row by row (an epoch re-run after a fault appears twice)."""
    path = Path(run_dir) / 'results.csv'
    if not path.is_file():
        return []
    with open(path) as f:
        return [int(row['epoch'].strip()) for row in csv.DictReader(f, skipinitialspace=True)]


def weights_snapshot(run_dir: Path) -> dict:
    """{file name: sha256} of a run's weights folder."""
    folder = Path(run_dir) / 'weights'
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())} \
        if folder.is_dir() else {}


def completed_run_problems(project: Path, epochs: int, task=DUAL) -> list:
    """Why the job under project did not end as a completed run ([] if it did): one run folder, every epoch in its
    results.csv, run.json finished, last.pt loadable and stripped as the task's upstream script leaves it (train.py:
    last_striped.pt), no temporary files."""
    from yolov9_ddp import checkpoints, runs
    from yolov9_ddp.tasks import TASKS
    folders = run_folders(project)
    if len(folders) != 1:
        return [f'{len(folders)} run folders under {project}: {[p.name for p in folders]}']
    run_dir = folders[0]
    problems = []
    rows = results_epochs(run_dir)
    if sorted(set(rows)) != list(range(epochs)):
        problems.append(f'results.csv has epochs {rows}, not every epoch 0..{epochs - 1}')
    if not runs.read_record(run_dir).get('finished'):
        problems.append('run.json does not record a finished run')
    stripped = TASKS[task].stripped(run_dir / 'weights' / 'last.pt')
    try:
        final = checkpoints.load_checkpoint(stripped)
        if final['epoch'] != -1 or final['optimizer'] is not None:
            problems.append(f'{stripped.name} is not the final stripped checkpoint (epoch {final["epoch"]})')
    except checkpoints.CheckpointError as e:
        problems.append(f'{stripped.name} does not load: {e}')
    temporaries = sorted(p.name for p in (run_dir / 'weights').glob('.*.tmp'))
    if temporaries:
        problems.append(f'temporary files left in weights/: {temporaries}')
    return problems


def epochs_redone(events: list) -> list:
    """For each kill, stall or signal stop that faulty_train.py saw: how many epochs were trained again because of
    it, i.e. the epoch in progress then - the epoch training next started at (rank 0) + 1; 1 means only the epoch
    in progress was lost (at most one checkpoint interval). None: training never started again."""
    starts = sorted((e for e in events if e['kind'] == 'start' and e['rank'] == 0), key=lambda e: e['time'])
    faults = [e for e in events if e['kind'] == 'fired' and e['fault']['action'] in DISRUPTIVE + ('stall',)]
    faults += [e for e in events if e['kind'] == 'exit' and e['rank'] == 0 and e['status'] > 128]
    redone = []
    for fault in sorted(faults, key=lambda e: e['time']):
        later = [s for s in starts if s['time'] > fault['time']]
        redone.append(fault['epoch'] - later[0]['start_epoch'] + 1 if later else None)
    return redone


class CheckpointWatcher:
    """Reads weights/last.pt and last.previous.pt of a run folder every time they change while a job runs: each
    version that exists must load as a checkpoint (files.atomic_write moves only whole files into place).

    Reading needs upstream's classes importable (the patched tree on sys.path). The final strip is written in one
    rename too, so every version is read until the job ends.
    """
    NAMES = ('last.pt', 'last.previous.pt')

    def __init__(self, run_dir: Path, interval=0.2):
        self.run_dir, self.interval = Path(run_dir), interval
        self.loaded, self.failures, self.seen = [], [], set()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join(60)

    def watch(self):
        import torch
        while not self.stopping.wait(self.interval):
            for name in self.NAMES:
                path = self.run_dir / 'weights' / name
                try:
                    stat = path.stat()
                    key = (name, stat.st_ino, stat.st_mtime_ns, stat.st_size)
                    if key in self.seen:
                        continue
                    data = path.read_bytes()
                except OSError:  # not there (yet), or moved aside between the stat and the read
                    continue
                self.seen.add(key)
                try:
                    ckpt = torch.load(io.BytesIO(data), map_location='cpu', weights_only=False)
                    assert isinstance(ckpt, dict) and 'model' in ckpt, 'not a checkpoint dict with a model'
                    self.loaded.append((name, ckpt.get('epoch')))
                except Exception as e:  # noqa: BLE001 - every failure to load is what this records
                    self.failures.append(f'{name} ({len(data)} bytes, seen while the job ran) does not load: '
                                         f'{type(e).__name__}: {str(e)[:160]}')

    @property
    def problems(self) -> list:
        return self.failures + ([] if self.loaded else ['no checkpoint was observed while the job ran'])


# -- the fault scenarios: tests/test_faults.py asserts on them in detail, bench/reliability.py counts them -------------

ERROR_LINE = 'ddp_train_dual.py: error'
KILL_FAULTS = {  # SIGKILLed workers under torchrun --max-restarts, by faulty_train.py (FAULT syntax there)
    'mid-step': Fault('kill', rank=1, epoch=1, step=3),
    'mid-validation': Fault('kill', rank=0, where='val', epoch=1),
    'mid-checkpoint-write': Fault('kill', rank=0, where='save', epoch=1),
    'between-checkpoint-renames': Fault('kill', rank=0, where='rename', epoch=1),
    'twice': [Fault('kill', rank=1, epoch=1, step=2, attempt=0), Fault('kill', rank=0, epoch=2, step=5, attempt=1)],
    'while-stripping-at-the-end': Fault('kill', rank=0, where='strip'),
}
# SIGKILLed loader workers (one per loader and rank: --workers 1), in every phase of a run
WORKER_KILL_FAULTS = {
    'training worker mid-step': Fault('killworker', rank=1, loader='train', epoch=1, step=3),
    'validation worker mid-step': Fault('killworker', rank=0, loader='val', epoch=1, step=2),
    'validation worker mid-validation': Fault('killworker', rank=1, loader='val', where='val', epoch=1),
    'training worker while rank 0 writes last.pt': Fault('killworker', rank=0, loader='train', where='save', epoch=1),
    'validation worker in the final validation': Fault('killworker', rank=0, loader='val', where='final_val'),
}
# An exception on one rank only, and the words its one error line must have
RAISE_FAULTS = {
    'in the loss': (Fault('raise', rank=1, where='loss', epoch=1, step=3),
                    ('ValueError: injected fault on rank 1 at loss',)),
    "in a dataset's __getitem__ (a loader worker)": (
        Fault('raise', rank=0, where='getitem', step=30),
        ('ValueError: injected fault on rank 0 at getitem', 'DataLoader worker')),
    'in validation': (Fault('raise', rank=1, where='val', epoch=0), ('ValueError: injected fault on rank 1 at val',)),
    'CUDA out of memory': (Fault('raise', rank=1, epoch=1, step=2, error='oom'), ('out of GPU memory',)),
    'a killed loader worker': (Fault('killworker', rank=0, loader='val', epoch=1, step=2), ('DataLoader worker',
                                                                                          'killed by signal')),
}
DISRUPTIVE = ('kill', 'killworker', 'raise')  # faulty_train.py actions that end the process they fire in
WORKERS = ('--workers', 1)  # loader workers, in the scenarios that kill them


@dataclass
class Outcome:
    project: Path
    jobs: list  # Job, in launch order
    problems: list  # why the scenario did not end as it should; [] if it did
    redone: list  # epochs trained again per fault (epochs_redone)
    watcher: CheckpointWatcher = None
    detail: dict = None  # what a scenario measured beside (seconds, records, ...)

    @property
    def output(self) -> str:
        return '\n'.join(job.output() for job in self.jobs)

    def describe(self) -> str:
        jobs = '\n'.join(f'--- {job.log.name}: exit {job.returncode} after {job.wall or 0:.1f} s\n'
                         f'{job.output()[-5000:]}' for job in self.jobs)
        return f'problems: {self.problems}\nepochs re-run per fault: {self.redone}\ndetail: {self.detail}\n{jobs}'


def fault_args(data, project, epochs=FAULT_EPOCHS, *extra, task=DUAL) -> list:
    """Training arguments of a scenario: the task's tiny model, batch 4 (2 per rank), 64 px, CPU, no loader
    workers."""
    return train_args(data, project, epochs, 4, 64, *extra, cfg=task_cfg(task))


def scenario_args(data, project, epochs=FAULT_EPOCHS, save_on_signal=True, task=DUAL, extra=()) -> list:
    """signal_scenario's training arguments, for a reference run of the same training."""
    return fault_args(data, project, epochs, *WORKERS, *(['--save-on-signal'] if save_on_signal else []), *extra,
                      task=task)


def final_state(run_dir: Path, epochs: int) -> dict:
    """Every tensor of the last epoch's full checkpoint (--save-period 1: not stripped, unlike last.pt), and its
    count of EMA updates."""
    import torch
    ckpt = torch.load(run_dir / 'weights' / f'epoch{epochs - 1}.pt', map_location='cpu', weights_only=False)
    tensors = {f'{key}.{name}': t for key in ('model', 'ema') for name, t in ckpt[key].state_dict().items()}
    for index, state in ckpt['optimizer']['state'].items():
        tensors.update({f'optimizer.{index}.{name}': t for name, t in state.items() if torch.is_tensor(t)})
    return {'tensors': tensors, 'updates': ckpt['updates']}


def differences(a: dict, b: dict) -> list:
    """The tensors of two final_state()s that are not bit-identical."""
    import torch
    assert a['tensors'].keys() == b['tensors'].keys() and a['updates'] == b['updates'] > 0
    return [name for name, t in a['tensors'].items() if not torch.equal(t, b['tensors'][name])]


def error_lines(output: str) -> list:
    return [line[line.index(ERROR_LINE):] for line in output.splitlines() if ERROR_LINE in line]


PEER_DIED = 'a collective operation failed'  # how a surviving rank reports a peer that was killed


def one_error_line_problems(output: str, *fragments, besides=()) -> list:
    """[] if the output has exactly one error line and it names every fragment, else what is wrong.

    Lines containing one of `besides` are expected on the way (a rank reporting a killed peer) and not counted."""
    lines = [line for line in error_lines(output) if not any(b in line for b in besides)]
    if len(lines) == 1 and all(f in lines[0] for f in fragments):
        return []
    shown = [line[:200] + ('...' if len(line) > 200 else '') for line in lines]
    return [f'expected one error line naming {fragments}; got {len(lines)}: {shown}']


def kill_scenario(tree, data, workdir: Path, fault: str, nproc=2, epochs=FAULT_EPOCHS, max_restarts=3,
                  timeout=300, extra=(), task=DUAL) -> Outcome:
    """torchrun --max-restarts with workers that faulty_train.py SIGKILLs (or makes raise) as `fault` says: the run
    must complete every epoch in one folder, restarted once per fault, with every checkpoint seen on the way
    loadable and no process of the job left afterwards."""
    project = workdir / 'runs'
    with CheckpointWatcher(project / 'exp') as watcher:
        job = start_job(faulty_torchrun(nproc, fault_args(data, project, epochs, *extra, task=task), max_restarts),
                        tree, workdir, 'job', fault, FAULT_TASK=task)
        job.wait(timeout)
    events = job.events()
    kills = [e for e in events if e['kind'] == 'fired' and e['fault']['action'] in DISRUPTIVE]
    expected = sum(f.action in DISRUPTIVE for f in ([fault] if isinstance(fault, Fault) else fault))
    problems = [] if len(kills) == expected else [f'{len(kills)} of the {expected} faults happened']
    problems += restarted_run_problems(job, project, epochs, len(kills), {k['epoch'] for k in kills}, task)
    return Outcome(project, [job], problems + watcher.problems, epochs_redone(events), watcher,
                   {'kills': kills, 'rows': results_epochs(project / 'exp')})


def random_kill_scenario(tree, data, workdir: Path, seed: int, nproc=2, epochs=6, max_restarts=3,
                         timeout=300) -> Outcome:
    """One process of a training job, chosen at random among the trainers and their loader workers, SIGKILLed at a
    random moment of its first 4 s of training (as the kernel's out-of-memory killer picks; 6 epochs last longer
    even on a fast machine): the run must complete as in kill_scenario."""
    rng = random.Random(seed)
    project = workdir / 'runs'
    job = start_job(faulty_torchrun(nproc, fault_args(data, project, epochs, *WORKERS), max_restarts), tree, workdir,
                    'job', Fault('mark', rank=0, epoch=0, step=1))
    wait_for_path(job.records / 'mark-mark', job)
    time.sleep(rng.uniform(0, 4))
    processes = {pid: parent_of(pid) for pid in processes_mentioning(job.marker) if pid != job.proc.pid}
    if not processes:
        job.wait(timeout)
        return Outcome(project, [job], ['the job ended before the kill'], [], None, {})
    victim = rng.choice(sorted(processes))
    detail = {'victim': 'trainer' if processes[victim] == job.proc.pid else 'loader worker',
              'after_start_s': round(time.monotonic() - job.started, 1)}
    os.kill(victim, signal.SIGKILL)
    job.wait(timeout)
    problems = restarted_run_problems(job, project, epochs, 1, None)
    return Outcome(project, [job], problems, [], None, detail)


def restarted_run_problems(job: Job, project: Path, epochs: int, faults: int, fault_epochs, task=DUAL) -> list:
    """Why a job restarted by torchrun after `faults` faults did not end as a completed run: its status, one
    restart per fault, every epoch in one folder, epochs repeated only where a fault struck (fault_epochs; None:
    not known), no process of the job left."""
    output = job.output()
    problems = [] if job.returncode == 0 else [f'exit status {job.returncode}']
    problems += [f'no "torchrun restart {n}: continuing" in the output' for n in range(1, faults + 1)
                 if f'torchrun restart {n}: continuing' not in output]
    problems += completed_run_problems(project, epochs, task)
    rows = results_epochs(project / 'exp')
    repeated = {e for e in rows if rows.count(e) > 1}
    if len(rows) - len(set(rows)) > faults or (fault_epochs is not None and not repeated <= fault_epochs):
        problems.append(f'results.csv rows {rows}: epochs repeated beyond one per fault')
    problems += leftover_problems(job)
    return problems


def failure_scenario(tree, data, workdir: Path, fault: str, fragments, nproc=2, deadline=90) -> Outcome:
    """A job without restarts in which one rank fails as `fault` says (a killed loader worker, an exception): it
    must end within `deadline` seconds with a non-zero status, exactly one error line naming every fragment (and
    the surviving ranks' lines about the failed peer), torchrun's summary showing that cause, and no process of
    the job left: a surviving rank must not wait out its --ddp-timeout."""
    job = start_job(faulty_torchrun(nproc, fault_args(data, workdir / 'runs', FAULT_EPOCHS, *WORKERS)), tree,
                    workdir, 'job', fault)
    job.wait(deadline)
    output = job.output()
    problems = [] if job.returncode else ['exit status 0 although a rank failed']
    if not job.events('fired'):
        problems.append('the fault did not fire')
    problems += one_error_line_problems(output, *fragments, besides=(PEER_DIED,))
    root_cause = output.rpartition('Root Cause (first observed failure):')[2].split('=' * 20)[0]
    if not all(f in root_cause for f in fragments) or 'error_file: <N/A>' in root_cause:
        problems.append(f"the root cause in torchrun's summary is not the kit's line: {root_cause.strip()[:800]}")
    problems += leftover_problems(job)
    return Outcome(workdir / 'runs', [job], problems, [], None, {'seconds': round(job.wall, 1)})


def leftover_problems(job: Job) -> list:
    """[] when no process of the job is left (loader workers included), else what is still running."""
    leftovers = lingering(job.marker)
    return [f'processes of the job still running: {leftovers}'] if leftovers else []


def lingering(marker: str, grace=5.0) -> list:
    """Processes whose command line has marker, still there after up to grace seconds."""
    deadline = time.monotonic() + grace
    while True:
        pids = processes_mentioning(marker)
        if not pids or time.monotonic() > deadline:
            return [(pid, Path(f'/proc/{pid}/cmdline').read_bytes()[:200]) for pid in pids
                    if Path(f'/proc/{pid}').exists()]
        time.sleep(0.1)


def signal_scenario(tree, data, workdir: Path, signum=signal.SIGTERM, save_on_signal=True, nproc=2,
                    epochs=FAULT_EPOCHS, resume=True, task=DUAL, kill='', extra=()) -> Outcome:
    """A job (torchrun with nproc > 1, else one process) with one loader worker per rank gets signum mid-epoch 1,
    sent to the launcher only: it must be gone within STOP_DEADLINE_S with exit status 128 + signum on every rank,
    the process group destroyed, no process left, one 'stopped on' line, and a resumable last.pt
    (--save-on-signal) or the last epoch's untouched; then `--resume last.pt` must complete the run.

    kill: a kill fault (faulty_train.py) of the job's first attempt in epoch 1, as kill_scenario's: torchrun
    (--max-restarts 1) must restart the job, which continues its run (every checkpoint seen on the way loadable,
    only the killed epoch trained twice), and the signal comes mid-epoch 2 of the restarted job instead (one job
    for both proofs; detail['signalled_epoch'] says which). extra: more training arguments (scenario_args)."""
    from yolov9_ddp import checkpoints
    from yolov9_ddp.tasks import TASKS
    project = workdir / 'runs'
    last = project / 'exp' / 'weights' / 'last.pt'
    args = scenario_args(data, project, epochs, save_on_signal, task, extra)
    watcher = CheckpointWatcher(project / 'exp') if kill else None
    if kill:
        fault = [replace(kill, attempt=0), replace(MARK_SLOW, epoch=2, attempt=1)]
        watcher.__enter__()
        job = start_job(faulty_torchrun(nproc, args, 1), tree, workdir, 'stopped', fault, FAULT_TASK=task)
    else:
        job = start_job(launch_cmd(nproc, FAULTY, *args), tree, workdir, 'stopped', MARK_SLOW, FAULT_TASK=task)
    try:
        wait_for_path(job.records / 'mark-mark', job)
        before = weights_snapshot(project / 'exp')
        signalled = time.monotonic()
        os.kill(job.proc.pid, signum)
        job.wait(STOP_DEADLINE_S)
    finally:
        if watcher:
            watcher.__exit__()
    detail = {'stop_seconds': round(time.monotonic() - signalled, 1), 'leftovers': lingering(job.marker),
              'signalled_epoch': 2 if kill else 1}
    output, name = job.output(), signal.Signals(signum).name
    problems = [] if job.returncode else ['exit status 0: the signal did not stop the job']
    if detail['leftovers']:
        problems.append(f'processes of the job still running: {detail["leftovers"]}')
    if kill:
        kills = [e for e in job.events('fired') if e['fault']['action'] in DISRUPTIVE]
        if len(kills) != 1 or 'torchrun restart 1: continuing' not in output:
            problems.append(f'{len(kills)} kills fired; the job was {"" if kills else "not "}restarted: expected 1 '
                            f'and a "torchrun restart 1: continuing" line')
        problems += watcher.problems
    exits = [e for e in job.events('exit') if e['attempt'] == (1 if kill else 0)]
    detail['exits'] = [(e['rank'], e['status'], e['destroyed']) for e in exits]
    if sorted(detail['exits']) != [(rank, 128 + signum, nproc > 1) for rank in range(nproc)]:
        problems.append(f'(rank, exit status, process group destroyed) of the workers: {detail["exits"]}; expected '
                        f'{128 + signum} on each of {nproc} ranks' + (', process group destroyed' if nproc > 1 else ''))
    stopped = f'{TASKS[task].script}: stopped on {name}'
    if output.count(stopped) != 1:
        problems.append(f'"{stopped}" appears {output.count("stopped on " + name)} times')
    if 'destroy_process_group' in output:
        problems.append('a warning about the process group not being destroyed')
    if f'{FAULTY.name}", line' in output:
        problems.append('a traceback from a worker')
    if save_on_signal:
        if f'resumable checkpoint written to {last}' not in output:
            problems.append('no "resumable checkpoint written to .../last.pt" line')
        try:
            detail['saved_epoch'] = checkpoints.load_checkpoint(last, require_resume_state=True)['epoch']
        except checkpoints.CheckpointError as e:
            problems.append(f'last.pt is not resumable after the stop: {e}')
    else:
        if 'no checkpoint written for the interrupted epoch' not in output:
            problems.append('no "no checkpoint written for the interrupted epoch" line')
        if weights_snapshot(project / 'exp') != before:
            problems.append('weights/ changed after the signal although --save-on-signal was not given')
    jobs = [job]
    if resume and not problems:
        resumed = resume_job(tree, workdir, last, nproc=nproc, task=task)
        jobs.append(resumed)
        if resumed.wait(300):
            problems.append(f'the resumed run exited with {resumed.returncode}')
        problems += completed_run_problems(project, epochs, task)
        rows = results_epochs(project / 'exp')
        if kill and not {e for e in rows if rows.count(e) > 1} <= {1, 2}:
            problems.append(f'results.csv rows {rows}: epochs repeated beyond those of the kill and the signal')
    return Outcome(project, jobs, problems, epochs_redone(sum((j.events() for j in jobs), [])), watcher, detail)


STALL_GRACE_S = 2  # torchrun's SIGTERM-to-SIGKILL grace in the stall scenario (testsupport/torchrun.py)


def stall_scenario(tree, data, workdir: Path, max_restarts=0, ddp_timeout=10, epochs=FAULT_EPOCHS,
                   timeout=150) -> Outcome:
    """Rank 1 hangs before the EMA all_reduce of epoch 0. Rank 0 must give up after --ddp-timeout with one error
    line naming the flag; the job fails (no restarts) or torchrun restarts it and the run completes. The hung rank
    ignores SIGTERM, so torchrun always waits out its grace before the SIGKILL: STALL_GRACE_S, the launcher's
    setting, not the kit's."""
    project = workdir / 'runs'
    fault = Fault('stall', rank=1, where='sync_ema', epoch=0)
    job = start_job(faulty_torchrun(2, fault_args(data, project, epochs, '--ddp-timeout', ddp_timeout), max_restarts),
                    tree, workdir, 'job', fault, TORCH_ELASTIC_SHUTDOWN_TIMEOUT=STALL_GRACE_S)
    job.wait(timeout)
    output, events = job.output(), job.events()
    stalls = [e for e in events if e['kind'] == 'fired']
    gave_up = [e for e in events if e['kind'] == 'exit' and e['rank'] == 0 and e['attempt'] == 0]
    problems, detail = [], {'job_seconds': round(job.wall, 1)}
    if len(stalls) != 1 or len(gave_up) != 1:
        return Outcome(project, [job], [f'stall fired {len(stalls)} times, rank 0 returned {len(gave_up)} times'],
                       [], None, detail)
    detail['rank0_gave_up_after'] = round(gave_up[0]['time'] - stalls[0]['time'], 1)
    if gave_up[0]['status'] != 1 or not ddp_timeout <= detail['rank0_gave_up_after'] <= ddp_timeout + 15:
        problems.append(f'rank 0 returned {gave_up[0]["status"]} {detail["rank0_gave_up_after"]} s after the stall')
    problems += one_error_line_problems(output, f'--ddp-timeout {ddp_timeout:g} s')
    problems += leftover_problems(job)
    if max_restarts == 0:
        if job.returncode == 0:
            problems.append('exit status 0 although a rank hung')
    else:
        if job.returncode:
            problems.append(f'exit status {job.returncode} although torchrun could restart')
        problems += completed_run_problems(project, epochs)
    return Outcome(project, [job], problems, epochs_redone(events), None, detail)


def interrupted_run(tree, data, workdir: Path, epochs=FAULT_EPOCHS, extra=()) -> Path:
    """The folder of a 2-process run (extra: more training arguments) killed (rank 1, SIGKILL, no restarts) at the
    start of its last epoch: weights/last.pt holds epoch E-2 and last.previous.pt epoch E-3."""
    from yolov9_ddp import checkpoints
    project = workdir / 'runs'
    job = start_job(faulty_torchrun(2, fault_args(data, project, epochs, *extra)), tree, workdir, 'interrupted',
                    Fault('kill', rank=1, epoch=epochs - 1, step=0))
    assert job.wait(300) != 0 and job.events('fired'), job.output()[-4000:]
    weights = project / 'exp' / 'weights'
    assert checkpoints.load_checkpoint(weights / 'last.pt')['epoch'] == epochs - 2, job.output()[-4000:]
    assert checkpoints.load_checkpoint(weights / 'last.previous.pt')['epoch'] == epochs - 3
    return project / 'exp'


def interrupted_copy(tree, data, workdir: Path, source: Path = None, epochs=FAULT_EPOCHS) -> Path:
    """workdir/runs/exp: a copy of source (an interrupted_run folder), else a freshly interrupted run."""
    import shutil
    if source:
        return Path(shutil.copytree(source, workdir / 'runs' / 'exp'))
    return interrupted_run(tree, data, workdir, epochs)


def damage(path: Path, how: str, tree=None):
    """Make a checkpoint unusable: 'truncated' (its first half), 'garbage' (random bytes, not a zip archive),
    'another-model' (a whole checkpoint, of the tiny model with nc=5 instead of 3; made in the tree)."""
    if how == 'truncated':
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    elif how == 'garbage':
        path.write_bytes(random.Random(0).randbytes(path.stat().st_size))
    elif how == 'another-model':
        code = ('import sys, torch\nfrom copy import deepcopy\nfrom models.yolo import Model\n'
                'ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=False)\n'
                'model = Model(sys.argv[2], ch=3, nc=5)\n'
                'ckpt["model"], ckpt["ema"] = deepcopy(model).half(), deepcopy(model).half()\n'
                'torch.save(ckpt, sys.argv[1])\n')
        result = run([sys.executable, '-c', code, str(path), str(TINY_CFG)], tree, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        raise ValueError(how)


def resume_job(tree, workdir: Path, last: Path, name='resumed', nproc=2, fault='', task=DUAL) -> Job:
    return start_job(launch_cmd(nproc, FAULTY, '--resume', last, '--device', 'cpu', '--workers', 0), tree, workdir,
                     name, fault, FAULT_TASK=task)


def fallback_scenario(tree, data, workdir: Path, source: Path = None, epochs=FAULT_EPOCHS) -> Outcome:
    """A truncated last.pt beside last.previous.pt: --resume must warn, continue from the previous checkpoint and
    complete the run. source: an interrupted_run folder to copy (else one is made)."""
    from yolov9_ddp import checkpoints, files
    run_dir = interrupted_copy(tree, data, workdir, source, epochs)
    last = run_dir / 'weights' / 'last.pt'
    previous = files.previous_path(last)
    damaged_epoch = checkpoints.load_checkpoint(last)['epoch']
    damage(last, 'truncated')
    job = resume_job(tree, workdir, last)
    job.wait(300)
    output = job.output()
    problems = [] if job.returncode == 0 else [f'exit status {job.returncode}']
    if not any(f'{last} is truncated or corrupt' in line and f'resuming from {previous} instead' in line
               for line in output.splitlines()):
        problems.append('no warning naming the damaged last.pt and the fallback to last.previous.pt')
    starts = [e for e in job.events('start') if e['rank'] == 0]
    if not starts or starts[-1]['weights'] != str(previous):
        problems.append(f'training did not start from {previous}: {starts}')
    problems += completed_run_problems(run_dir.parent, epochs)
    redone = [damaged_epoch + 1 - starts[-1]['start_epoch']] if starts else [None]
    return Outcome(run_dir.parent, [job], problems, redone, None, {'damaged_epoch': damaged_epoch})


def slow_filesystem_resume_scenario(tree, data, workdir: Path, source: Path = None, epochs=FAULT_EPOCHS) -> Outcome:
    """--resume on 2 ranks where rank 0's rewrite of the run's opt.yaml takes 5 s (a slow shared filesystem) and
    rank 1 is 1.5 s late: the run must complete, every rank starting from the run's saved options."""
    run_dir = interrupted_copy(tree, data, workdir, source, epochs)
    job = resume_job(tree, workdir, run_dir / 'weights' / 'last.pt',
                     fault=[Fault('slow', rank=0, where='opt_yaml', sleep=5),
                            Fault('slow', rank=1, where='resume_options', sleep=1.5)])
    job.wait(300)
    problems = [] if len(job.events('fired')) == 2 else ['the slow filesystem was not simulated on both ranks']
    if job.returncode:
        problems.append(f'exit status {job.returncode}' + ''.join(
            f'; {line.strip()[:200]}' for line in job.output().splitlines() if 'Error:' in line)[:600])
    problems += completed_run_problems(run_dir.parent, epochs)
    return Outcome(run_dir.parent, [job], problems, [])


def refusal_problems(job: Job, run_dir: Path, before: dict, rows_before: list, *fragments) -> list:
    """Why a launch that must be refused was not refused cleanly: non-zero exit within 60 s, exactly one error
    line naming the fragments, no traceback of ours, no training started, nothing written to weights/."""
    output = job.output()
    problems = [] if job.returncode else ['exit status 0']
    if job.wall > 60:
        problems.append(f'took {job.wall:.0f} s')
    problems += one_error_line_problems(output, *fragments)
    if 'ddp_train_dual.py", line' in output:
        problems.append('a traceback through ddp_train_dual.py')
    if 'Starting training' in output or job.events('start'):
        problems.append('training started')
    if weights_snapshot(run_dir) != before:
        problems.append(f'weights/ changed: {sorted(before)} -> {sorted(weights_snapshot(run_dir))}')
    if results_epochs(run_dir) != rows_before:
        problems.append('results.csv changed')
    return problems


def refused_checkpoint_scenario(tree, data, workdir: Path, how: str, source: Path = None,
                                keep_previous=False) -> Outcome:
    """--resume with a damaged last.pt (damage(how)) and, unless keep_previous, no last.previous.pt: one clear error,
    every rank out, no training, weights/ untouched."""
    from yolov9_ddp import files
    run_dir = interrupted_copy(tree, data, workdir, source)
    last = run_dir / 'weights' / 'last.pt'
    if not keep_previous:
        files.previous_path(last).unlink()
    damage(last, how, tree)
    before, rows = weights_snapshot(run_dir), results_epochs(run_dir)
    job = resume_job(tree, workdir, last)
    job.wait(120)
    fragments = (str(last), 'holds another model') if how == 'another-model' else (str(last), 'truncated or corrupt')
    return Outcome(run_dir.parent, [job], refusal_problems(job, run_dir, before, rows, *fragments), [])


def lost_checkpoints_scenario(tree, data, workdir: Path, via: str, source: Path = None,
                              epochs=FAULT_EPOCHS) -> Outcome:
    """run.json records a saved epoch but the checkpoints are gone: --auto-resume (via='auto-resume') or a torchrun
    restart (via='torchrun-restart': faulty_train.py deletes them, then kills rank 0) must stop with a clear error,
    never start over from scratch."""
    project = workdir / 'runs'
    fragments = ('records a checkpoint of epoch', 'are gone')
    if via == 'auto-resume':
        run_dir = interrupted_copy(tree, data, workdir, source, epochs)
        for path in (run_dir / 'weights').glob('*.pt'):
            path.unlink()
        before, rows = weights_snapshot(run_dir), results_epochs(run_dir)
        job = start_job(faulty_torchrun(2, fault_args(data, project, epochs, '--auto-resume')), tree, workdir,
                        'auto-resumed')
        job.wait(120)
        problems = refusal_problems(job, run_dir, before, rows, *fragments)
    else:
        fault = Fault('kill', rank=0, epoch=epochs - 1, step=0, wipe=True)
        job = start_job(faulty_torchrun(2, fault_args(data, project, epochs), 1), tree, workdir, 'restarted', fault)
        job.wait(180)
        output, run_dir = job.output(), project / 'exp'
        problems = [] if job.returncode else ['exit status 0']
        if sorted(e['rank'] for e in job.events('exit') if e['attempt'] == 1) != [0, 1]:
            problems.append('torchrun did not restart the workers, or they did not return by themselves')
        problems += one_error_line_problems(output, *fragments, besides=(PEER_DIED,))  # rank 1, when 0 was killed
        if output.count('Starting training') != 1 or len([e for e in job.events('start') if e['rank'] == 0]) != 1:
            problems.append('training started again after the restart')
        if results_epochs(run_dir) != list(range(epochs - 1)) or weights_snapshot(run_dir):
            problems.append(f'results.csv {results_epochs(run_dir)} / weights {sorted(weights_snapshot(run_dir))} '
                            f'changed after the restart')
        if len(run_folders(project)) != 1:
            problems.append(f'run folders: {run_folders(project)}')
    return Outcome(project, [job], problems, [])
