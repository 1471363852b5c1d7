"""The faults a test injects into a real job: typed values, handed to the fault driver
(testsupport/probes/faulty_train.py) as JSON in the environment variable FAULT, one list for every process of the job.

    job = faults.start_job(cmd, tree, workdir, 'job', [Fault('kill', rank=1, epoch=1, step=3)])

Each fault fires at most once per process, on its rank and torchrun attempt, where the driver reaches its place.
Standard library only: the driver imports it beside the patched tree's own packages.
"""
import json
from dataclasses import asdict, dataclass

# what a fault does
ACTIONS = {
    'kill': 'SIGKILL the rank (no Python clean-up, as the OOM killer or a lost node)',
    'killworker': 'SIGKILL one loader worker of the rank (`loader`: train or val), as the OOM killer often picks one',
    'raise': 'raise an exception on this rank only (`error`: value, a ValueError as a bug raises; oom, CUDA\'s)',
    'stall': 'sleep for good (a hung rank); only a signal ends it',
    'mark': 'write FAULT_DIR/mark-NAME, then go on after `sleep` seconds: tells a test that training got there',
    'slow': 'sleep `sleep` seconds there, then go on (a slow rank, a slow shared filesystem)',
    'hold': 'wait there until the rank is asked to stop (a signal), `sleep` seconds at most',
}
# where it does it: the points of the training loop's parts (yolov9_ddp/parts/), the collaborators the driver's part
# wraps there, and three places before or after the loop
PLACES = {
    'step': 'before step `step` of `epoch` (parts: before_step)',
    'loss': 'in the loss of step `step` of `epoch`, after the forward pass (the trainer\'s compute_loss)',
    'getitem': 'in the training dataset\'s __getitem__, at its `step`-th call in the process that runs it',
    'val': 'in the validation after `epoch`, once its first batch went through the model (the validation loader)',
    'final_val': 'in the validation of best.pt at the end of training, once its first batch went through',
    'sync_ema': 'at the end of `epoch`, before the EMA and BatchNorm synchronisation (parts: after_epoch)',
    'save': 'rank 0 writing last.pt of `epoch`: half of the temporary file written and on disk',
    'rename': 'rank 0 writing last.pt of `epoch`: the old one moved to last.previous.pt, the new not yet in place',
    'strip': 'the end of training, rank 0: half of the stripped last.pt written',
    'resume_options': 'before a resumed start takes the run\'s options (build.restore_resumed_options)',
    'opt_yaml': 'rank 0 writing the run\'s opt.yaml (build.save_options)',
    'report': 'a failed rank about to print, or leave to another rank, its one error line (entry.report)',
}


@dataclass(frozen=True)
class Fault:
    action: str
    where: str = 'step'
    rank: int = 0
    attempt: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT
    epoch: int = None  # None: any
    step: int = 0
    sleep: float = 0.0
    name: str = 'mark'
    wipe: bool = False  # first delete the run's weights/*.pt (checkpoints lost with a node's disk); where='step'
    loader: str = 'train'
    error: str = 'value'

    def __post_init__(self):
        if self.action not in ACTIONS or self.where not in PLACES:
            raise ValueError(f'{self}: actions are {sorted(ACTIONS)}, places {sorted(PLACES)}')


def to_env(faults) -> str:
    """The value of FAULT for one Fault, a list of them, or none."""
    faults = [faults] if isinstance(faults, Fault) else list(faults or ())
    return json.dumps([asdict(fault) for fault in faults])


def from_env(text: str) -> list:
    return [Fault(**item) for item in json.loads(text or '[]')]
