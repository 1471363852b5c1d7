"""Command line of the kit's entry points: every flag of the upstream script each replaces (train.py,
train_dual.py, train_triple.py, segment/train.py, segment/train_dual.py), same meaning, plus the kit's own.

Defaults that differ name files upstream does not ship: without --data the run trains on a generated demo dataset
(and without --cfg or --weights, the task's tiny model), --hyp is data/hyps/hyp.scratch-high.yaml, and the segment
scripts' --weights yolo-seg.pt becomes '' (from scratch).
"""
import argparse
from pathlib import Path

import yaml

from yolov9_ddp import perf
from yolov9_ddp.comm import DEFAULT_TIMEOUT_S, Unanimous
from yolov9_ddp.stream import QUAD

MODELS = Path(__file__).resolve().parent / 'models'  # the kit's tiny model configs, one per task


class UsageError(Unanimous):
    """A flag combination that cannot work; every rank detects it the same way before any collective."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, but a command line it cannot read (a misspelt flag, a value of the wrong type) is a UsageError:
    one line from rank 0, named in torchrun's summary (entry.report), not argparse's usage block from every rank."""

    def error(self, message):
        raise UsageError(f'{message} (--help lists the flags)')


def build_parser(root: Path, task) -> argparse.ArgumentParser:
    p = ArgumentParser(
        description=f'Train YOLOv9 models ending in {" or ".join(task.heads)} on one or many processes (torchrun), '
                    f'with the same flags as {task.upstream}.',
        epilog=f'Launch: torchrun --nproc_per_node N {task.script} ARGS (one process per GPU; --device cpu runs '
               f'N CPU processes with gloo). Without torchrun it trains in one process.')
    add_upstream_flags(p, root, task)
    add_kit_flags(p)
    return p


def add_upstream_flags(p, root: Path, task):
    """The flags of the upstream script the task replaces: same spelling, type, default and meaning (tested against
    upstream's parsers), except the defaults that name files upstream does not ship (see the module doc)."""
    masks = task.masks
    p.add_argument('--weights', type=str, default='', help='initial weights path')
    p.add_argument('--cfg', type=str, default='' if masks else 'yolo.yaml',
                   help="model.yaml path (with no --data, --cfg and --weights: the kit's tiny demo model)")
    p.add_argument('--data', type=str, default=None,
                   help='dataset.yaml path (default: a small demo dataset the kit generates, see --demo-dir)')
    p.add_argument('--hyp', type=str, default=root / 'data/hyps/hyp.scratch-high.yaml', help='hyperparameters path')
    p.add_argument('--epochs', type=int, default=100, help='total training epochs')
    p.add_argument('--batch-size', type=int, default=16, help='total batch size for all processes, -1 for autobatch')
    p.add_argument('--imgsz', '--img', '--img-size', type=int, default=640, help='train, val image size (pixels)')
    p.add_argument('--rect', action='store_true', help='rectangular training')
    p.add_argument('--resume', nargs='?', const=True, default=False, help='resume most recent training')
    p.add_argument('--nosave', action='store_true', help='only save final checkpoint')
    p.add_argument('--noval', action='store_true', help='only validate final epoch')
    p.add_argument('--noautoanchor', action='store_true', help='disable AutoAnchor (a no-op, as upstream)')
    p.add_argument('--noplots', action='store_true', help='save no plot files')
    p.add_argument('--evolve', type=int, nargs='?', const=300,
                   help=f'evolve hyperparameters: not supported here, use {task.upstream}')
    p.add_argument('--bucket', type=str, default='', help='gsutil bucket (only used by --evolve)')
    p.add_argument('--cache', type=str, nargs='?', const='ram', help='image --cache ram/disk')
    p.add_argument('--image-weights', action='store_true',
                   help='use weighted image selection for training (one process only)')
    p.add_argument('--device', default='', help="cuda device, i.e. 0 or 0,1,2,3 or cpu; LOCAL_RANK picks the GPU")
    p.add_argument('--multi-scale', action='store_true', help='vary img-size +/- 50%%')
    p.add_argument('--single-cls', action='store_true', help='train multi-class data as single-class')
    p.add_argument('--optimizer', type=str, choices=['SGD', 'Adam', 'AdamW', 'LION'], default='SGD', help='optimizer')
    p.add_argument('--sync-bn', action='store_true', help='use SyncBatchNorm, only available in DDP mode on CUDA')
    p.add_argument('--workers', type=int, default=8, help='max dataloader workers (per RANK in DDP mode)')
    p.add_argument('--project', default=root / ('runs/train-seg' if masks else 'runs/train'),
                   help='save to project/name')
    p.add_argument('--name', default='exp', help='save to project/name')
    p.add_argument('--exist-ok', action='store_true', help='existing project/name ok, do not increment')
    p.add_argument('--quad', action='store_true', help='quad dataloader')
    p.add_argument('--cos-lr', action='store_true', help='cosine LR scheduler')
    if task.flat_and_fixed_lr:
        p.add_argument('--flat-cos-lr', action='store_true', help='flat cosine LR scheduler')
        p.add_argument('--fixed-lr', action='store_true', help='fixed LR scheduler')
    p.add_argument('--label-smoothing', type=float, default=0.0, help='Label smoothing epsilon')
    p.add_argument('--patience', type=int, default=100, help='EarlyStopping patience (epochs without improvement)')
    p.add_argument('--freeze', nargs='+', type=int, default=[0], help='Freeze layers: backbone=10, first3=0 1 2')
    p.add_argument('--save-period', type=int, default=-1, help='Save checkpoint every x epochs (disabled if < 1)')
    p.add_argument('--seed', type=int, default=0, help='Global training seed')
    p.add_argument('--local_rank', '--local-rank', type=int, default=-1,
                   help='set by python -m torch.distributed.launch; torchrun sets LOCAL_RANK instead')
    if not masks:
        p.add_argument('--min-items', type=int, default=0, help='Experimental')
    p.add_argument('--close-mosaic', type=int, default=0, help='Experimental')
    if masks:
        p.add_argument('--mask-ratio', type=int, default=4, help='Downsample the truth masks to saving memory')
        p.add_argument('--no-overlap', action='store_true', help='Overlap masks train faster at slightly less mAP')
    else:
        p.add_argument('--entity', default=None, help='Entity')
        p.add_argument('--upload_dataset', nargs='?', const=True, default=False, help='Upload data, "val" option')
        p.add_argument('--bbox_interval', type=int, default=-1, help='Set bounding-box image logging interval')
        p.add_argument('--artifact_alias', type=str, default='latest', help='Version of dataset artifact to use')


def add_kit_flags(p):
    """The kit's own flags, the same for every entry point."""
    kit = p.add_argument_group('yolov9-ddp')
    kit.add_argument('--ddp-timeout', type=float, default=DEFAULT_TIMEOUT_S, metavar='SECONDS',
                     help='how long a rank waits in a collective before the job fails (default: %(default)s s = 3 h; '
                          'a stuck rank then stops the job instead of hanging it)')
    kit.add_argument('--auto-resume', action='store_true',
                     help='continue PROJECT/NAME from its last checkpoint if it holds an unfinished run, else start '
                          'there (for schedulers that requeue the same command); torchrun restarts resume anyway')
    kit.add_argument('--save-on-signal', action='store_true',
                     help='on SIGTERM/SIGINT, stop all ranks after the same step and write a resumable last.pt '
                          '(without it the run stops cleanly and resumes from its last complete epoch)')
    kit.add_argument('--checkpoint-steps', type=int, default=0, metavar='N',
                     help='write a resumable last.pt every N optimizer steps (default: 0, off), off the training '
                          'thread, atomically, keeping the previous one as last.previous.pt; a write still running '
                          'when the next is due makes that one skipped')
    kit.add_argument('--checkpoint-minutes', type=float, default=0, metavar='M',
                     help='write a resumable last.pt every M minutes (default: 0, off), as --checkpoint-steps: a '
                          'SIGKILL (the OOM killer, a lost node) then costs about M minutes of training')
    kit.add_argument('--max-restarts', type=int, default=0, metavar='N',
                     help='with a --device list outside torchrun, which starts the job itself: restart its workers up '
                          'to N times after a failure, as torchrun --max-restarts (default: 0)')
    kit.add_argument('--levers', metavar='NAME=0|1,...', default=None,
                     help=f'performance switches ({", ".join(perf.SWITCHES)}), e.g. cudnn_benchmark=0 (recorded in '
                          'opt.yaml: a resume keeps the run\'s unless given again; docs/clone.md)')
    kit.add_argument('--channels-last', action='store_true', help='short for --levers channels_last=1')
    kit.add_argument('--deterministic', action='store_true',
                     help="bit-reproducible: the same seed and number of processes give identical weights (upstream's "
                          'numerics: cudnn_benchmark, fused_optimizer, channels_last and dense_box_loss off; '
                          'torch.use_deterministic_algorithms; CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set)')
    kit.add_argument('--compile', action='store_true', help='refused: torch.compile does not pay (docs/benchmarks.md)')
    kit.add_argument('--demo-dir', type=Path, default=None,
                     help='where the demo dataset is generated when --data is not given '
                          '(default: PROJECT/../demo-data, demo-data-seg for segmentation)')
    return p


def parse_args(argv, root: Path, task):
    opt = build_parser(root, task).parse_args(argv)
    opt.hyp, opt.project = str(opt.hyp), str(opt.project)
    return opt


def given_flags(argv, root: Path, task) -> dict:
    """{option name: flag} of the flags the command line gives rather than leaves at their defaults: on resume they
    are this start's own (--device, --workers) or are named as overruled by the run's (yolov9_ddp.runs)."""
    parser = build_parser(root, task)
    for action in parser._actions:  # a flag whose default is SUPPRESS is left out of the options unless given
        action.default = argparse.SUPPRESS
    given = vars(parser.parse_args(argv))
    return {action.dest: action.option_strings[0] for action in parser._actions if action.dest in given}


def uses_demo(opt) -> bool:
    return opt.data is None


def names_no_model(opt) -> bool:
    """Neither --cfg nor --weights given (the upstream scripts' default --cfg is 'yolo.yaml' or '')."""
    return opt.cfg in ('', 'yolo.yaml') and not opt.weights


def check_launch(opt):
    """Reject what this start's flags cannot mean, before they choose the run (and, on resume, its options)."""
    if opt.ddp_timeout <= 0:
        raise UsageError('--ddp-timeout must be a positive number of seconds')
    if opt.checkpoint_steps < 0:
        raise UsageError(f'--checkpoint-steps {opt.checkpoint_steps}: give a number of optimizer steps, or 0 for none')
    if not opt.checkpoint_minutes >= 0:  # nan too
        raise UsageError(f'--checkpoint-minutes {opt.checkpoint_minutes}: give a number of minutes, or 0 for none')
    if opt.resume and opt.auto_resume:
        raise UsageError('give either --resume or --auto-resume, not both')
    if opt.max_restarts < 0:
        raise UsageError(f'--max-restarts {opt.max_restarts}: give a number of restarts, or 0 for none')


def divisors(n: int) -> list:
    """The process counts a global batch of n images splits over evenly."""
    return [d for d in range(1, n + 1) if n % d == 0]


def uneven_split(batch: int, world_size: int) -> str:
    """Why a resumed run cannot continue on world_size processes: its global batch is its own, the count is not."""
    *most, largest = divisors(batch)
    counts = f'{", ".join(map(str, most))} or {largest}' if most else str(largest)
    return f"the run's global batch {batch} cannot be split over {world_size} processes; it can over {counts}"


def head_of(cfg) -> str:
    """The class name of a model's output layer, from its yaml (a path or the dict a model keeps as .yaml)."""
    source = 'the checkpoint\'s model' if isinstance(cfg, dict) else cfg
    if not isinstance(cfg, dict):
        with open(cfg, errors='ignore') as f:
            cfg = yaml.safe_load(f)
    try:
        return str(cfg['head'][-1][2])
    except (KeyError, IndexError, TypeError) as e:
        raise UsageError(f'{source}: not a YOLOv9 model config (it has no head)') from e


def check_options(opt, world_size: int, task):
    """Reject what cannot work, identically on every rank (so all stop together, before any collective); on resume
    opt holds the run's own options."""
    ddp = world_size > 1
    if opt.evolve:
        raise UsageError(f'--evolve is not supported by {task.script}; run hyperparameter evolution with '
                         f'{task.upstream} (patched by the kit, it works on one process)')
    if opt.quad and task.masks:
        raise UsageError(f'--quad does not work with masks ({task.upstream} has no four-image collation of masks)')
    if opt.quad and 0 < opt.batch_size < QUAD * world_size:
        raise UsageError(f'--quad makes one image of each {QUAD} a process loads: --batch-size {opt.batch_size} on '
                         f'{world_size} process(es) gives each fewer; use {QUAD * world_size} or more')
    if ddp and opt.image_weights:
        raise UsageError('--image-weights is not compatible with DDP (each rank would draw other images); '
                         'train on one process or drop the flag')
    if ddp and opt.batch_size == -1:
        raise UsageError('AutoBatch (--batch-size -1) is not compatible with DDP; pass a --batch-size')
    if ddp and opt.batch_size % world_size:  # a resumed run's batch is its own: other process counts can
        raise UsageError(uneven_split(opt.batch_size, world_size) if opt.resume else
                         f'--batch-size {opt.batch_size} is not a multiple of the {world_size} processes; '
                         f'use a multiple of {world_size}')
    if opt.batch_size < -1 or opt.batch_size == 0:
        raise UsageError(f'--batch-size {opt.batch_size} is not a batch size')
    if opt.epochs < 1:
        raise UsageError(f'--epochs {opt.epochs}: train for at least one epoch')
    try:
        perf.checked(opt, world_size, task)
    except ValueError as e:
        raise UsageError(str(e)) from e
    for flag in ('data', 'hyp', 'weights'):
        value = getattr(opt, flag)
        if value and not opt.resume and not str(value).startswith(('http://', 'https://')) \
                and not Path(value).is_file():
            raise UsageError(f'--{flag} {value}: no such file')
    if opt.cfg and not opt.resume and Path(opt.cfg).is_file():  # else upstream's check_yaml finds it, later
        wrong = task.wrong_entry_point(head_of(opt.cfg))
        if wrong:
            raise UsageError(wrong)
