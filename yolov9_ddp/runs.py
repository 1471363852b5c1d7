"""The run folder: which one a run writes to, and where it resumes from.

Only global rank 0 decides, before the process group exists (comm.rank0_decides sends the decision to the other
ranks), and it creates the folder only once the options have passed their checks.

  --resume [last.pt]   continue that run (default: the newest last.pt under the current folder, as upstream)
  --auto-resume        continue PROJECT/NAME if it holds an unfinished run, else start it there
  torchrun restart     when torchrun restarts the workers after a failure (--max-restarts), the same
                       command runs again; the folder recorded for this torchrun job is found through
                       run.json and the run continues from its last checkpoint instead of starting over
  otherwise            a new PROJECT/NAME{,2,3,...} folder, as upstream's increment_path

run.json records the launcher's job id, the position (epoch, step) of the newest checkpoint and whether training
finished; rank 0 holds the folder's lock while it trains (hold_run). A resumed run keeps its own options (opt.yaml,
as upstream's --resume), but for how this start runs (START_OPTIONS); the world size is this start's.
"""
import fcntl
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import yaml

from yolov9_ddp.checkpoints import CheckpointError
from yolov9_ddp.files import atomic_write, previous_path

RUN_RECORD = 'run.json'
RUN_LOCK = '.lock'
HELD = []  # the lock files this process holds open: a lock lasts as long as its process
# this start's where given, else the run's; --epochs changes the run's total (extend.py)
START_OPTIONS = ('device', 'workers', 'ddp_timeout', 'save_on_signal', 'checkpoint_steps', 'checkpoint_minutes',
                 'epochs')
LAUNCH_OPTIONS = ('local_rank', 'auto_resume', 'max_restarts')  # always this start's: how it was launched
# given on resume without being overruled: --resume itself, the checkpoint that replaces --weights, the levers,
# which change the run's (perf.resumed), and --deterministic, which a resume may set
NOT_OVERRULED = ('resume', 'weights', 'levers', 'channels_last', 'deterministic')


@dataclass(frozen=True)
class RunPlan:
    save_dir: Path
    resume_from: Path = None  # a last.pt to continue from, or None for a fresh start
    finished: bool = False  # the folder's training already completed (a restart after the very end)
    reason: str = 'new run'
    options: dict = None  # the run's saved opt.yaml, when it resumes


def launcher_job_id():
    """An id that stays the same when torchrun restarts its workers, or None outside torchrun."""
    run_id = os.environ.get('TORCHELASTIC_RUN_ID')
    if run_id is None:
        return None
    if run_id != 'none':  # --rdzv-id given (multi-node launches always give one)
        return run_id
    # Single-node torchrun leaves the id at 'none'; its log folder is unique to this torchrun invocation.
    error_file = os.environ.get('TORCHELASTIC_ERROR_FILE', '')
    return error_file.split('/attempt_')[0] or None


def restart_count() -> int:
    return int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0))


def read_record(folder: Path) -> dict:
    try:
        return json.loads((Path(folder) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}


def write_record(folder: Path, **fields):
    text = json.dumps({**read_record(folder), **fields}, indent=1, sort_keys=True) + '\n'
    atomic_write(Path(folder) / RUN_RECORD, lambda f: f.write(text.encode()))


def find_job_folder(project: Path, job_id: str):
    """The newest folder under project whose run.json names this launcher job."""
    matches = [p.parent for p in Path(project).glob(f'*/{RUN_RECORD}') if read_record(p.parent).get('job') == job_id]
    return max(matches, key=lambda p: (p / RUN_RECORD).stat().st_mtime) if matches else None


def continue_in(folder: Path, reason: str) -> RunPlan:
    record = read_record(folder)
    last = folder / 'weights' / 'last.pt'
    if record.get('finished'):
        return RunPlan(folder, None, True, f'{reason}: training in {folder} already finished')
    if last.is_file() or previous_path(last).is_file():
        return RunPlan(folder, last, False, reason)  # load_for_resume() falls back to the previous one
    if record.get('saved_epoch') is not None:  # never start over silently when checkpoints were written
        raise CheckpointError(f'{folder}/run.json records a checkpoint of epoch {record["saved_epoch"]}, but '
                              f'{last} and {previous_path(last).name} are gone; restore one or start a new run')
    return RunPlan(folder, None, False, f'{reason} (no checkpoint yet: starting over in the same folder)')


def plan_run(opt, latest_run, increment_path) -> RunPlan:
    """Decide the run folder (rank 0). latest_run and increment_path are upstream's helpers."""
    if opt.resume:
        last = Path(opt.resume if isinstance(opt.resume, str) else latest_run())
        if not last.is_file():
            raise CheckpointError(f'--resume: {opt.resume if isinstance(opt.resume, str) else "no last.pt found"}'
                                  f' is not a checkpoint file; give --resume path/to/weights/last.pt')
        return RunPlan(last.parent.parent, last, False, f'resuming from {last}')
    job = launcher_job_id()
    if restart_count() > 0 and job:
        folder = find_job_folder(Path(opt.project), job)
        if folder is not None:
            return continue_in(folder, f'torchrun restart {restart_count()}: continuing {folder}')
    if opt.auto_resume:
        folder = Path(opt.project) / opt.name
        if (folder / RUN_RECORD).is_file():
            return continue_in(folder, f'--auto-resume: continuing {folder}')
        return RunPlan(folder, None, False, f'--auto-resume: new run in {folder}')
    return RunPlan(Path(increment_path(Path(opt.project) / opt.name, exist_ok=opt.exist_ok)))


class RunBusy(Exception):
    """Another start of the run is still training it."""


def start_record(plan: RunPlan):
    """The folder held and its record begun; a finished run stays marked so until it trains again (parts/finish.py),
    so that a start refused before that leaves it finished."""
    (plan.save_dir / 'weights').mkdir(parents=True, exist_ok=True)
    hold_run(plan.save_dir)
    begun = read_record(plan.save_dir)
    write_record(plan.save_dir, job=launcher_job_id(), finished=bool(begun.get('finished')))


def hold_run(folder: Path):
    """Rank 0 holds the run folder's lock (flock: released however its process ends) while it lives, so that a
    second start of the run (a --resume typed too early) is refused in one line instead of writing the same files.
    A filesystem that cannot lock holds nothing."""
    lock = open(folder / RUN_LOCK, 'a+')
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or 'another process'
        lock.close()
        raise RunBusy(f'{folder} is being trained by {holder}: a run trains in one start at a time; wait for it '
                      f'to end, or stop it first') from None
    except OSError:  # no locks here (some network filesystems)
        lock.close()
        return
    lock.seek(0)
    lock.truncate()
    lock.write(f'process {os.getpid()} on {socket.gethostname()}')
    lock.flush()
    HELD.append(lock)


def saved_options(plan: RunPlan) -> dict:
    """The run's opt.yaml (rank 0 reads it: the other ranks may not see the folder, and rank 0 rewrites it)."""
    saved = plan.save_dir / 'opt.yaml'
    try:
        options = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CheckpointError(f'{saved} is unreadable ({e}): cannot resume the run in {plan.save_dir}')
    if not isinstance(options, dict):
        raise CheckpointError(f'{saved} holds no options: cannot resume the run in {plan.save_dir}')
    return options


def resumed_options(options: dict, recorded: dict, given: dict) -> dict:
    """The options of a resumed start: the run's recorded ones, except how this start was launched and the start
    options its command line gives (given: {option name: flag}, cli.given_flags)."""
    own = {k: v for k, v in options.items() if k in LAUNCH_OPTIONS or (k in START_OPTIONS and k in given)}
    return {**options, **recorded, **own}


def overruled_flags(options: dict, recorded: dict, given: dict) -> list:
    """'--flag VALUE (the run has X)' for each flag given to a resumed start that the run's own value overrules."""
    kept = START_OPTIONS + LAUNCH_OPTIONS + NOT_OVERRULED
    return [f'{flag} {options[name]} (the run has {shown(recorded[name])})' for name, flag in given.items()
            if name in recorded and name not in kept and not same_setting(options[name], recorded[name])]


def same_setting(given, recorded) -> bool:
    """Whether a given flag says what the run recorded: a --hyp file names the hyperparameters a run records."""
    if isinstance(recorded, dict):
        try:
            named = yaml.safe_load(Path(given).read_text())
        except (OSError, yaml.YAMLError):
            return False
        return isinstance(named, dict) and all(recorded.get(k) == v for k, v in named.items())
    return str(given) == str(recorded)


def shown(recorded) -> str:
    return 'its own, in opt.yaml' if isinstance(recorded, dict) else str(recorded)
