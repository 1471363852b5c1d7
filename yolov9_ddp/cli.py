"""Command line of ddp_train_dual.py: every flag of upstream's train_dual.py, same meaning, plus the kit's own.

Two defaults differ on purpose: without --data the run trains on the kit's generated demo dataset
(and, without --cfg or --weights, the kit's tiny model), so the command works on a fresh machine.
"""
import argparse
from pathlib import Path

from yolov9_ddp.comm import DEFAULT_TIMEOUT_S, Unanimous
from yolov9_ddp.levers import levers_for

DEMO_CFG = Path(__file__).resolve().parent / 'models' / 'tiny-dual.yaml'


class UsageError(Unanimous):
    """A flag combination that cannot work; every rank detects it the same way before any collective."""


def build_parser(root: Path) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description='Train a YOLOv9 dual-head model on one or many processes (torchrun), with the same flags as '
                    'train_dual.py.',
        epilog='Launch: torchrun --nproc_per_node N ddp_train_dual.py ARGS (one process per GPU; --device cpu runs '
               'N CPU processes with gloo). Without torchrun it trains in one process.')
    # -- the flags of upstream's train_dual.py, same spelling, type, default and meaning --------------------------
    p.add_argument('--weights', type=str, default='', help='initial weights path')
    p.add_argument('--cfg', type=str, default='yolo.yaml',
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
    p.add_argument('--noautoanchor', action='store_true', help='disable AutoAnchor (a no-op, as in train_dual.py)')
    p.add_argument('--noplots', action='store_true', help='save no plot files')
    p.add_argument('--evolve', type=int, nargs='?', const=300,
                   help='evolve hyperparameters: not supported here, use train_dual.py')
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
    p.add_argument('--project', default=root / 'runs/train', help='save to project/name')
    p.add_argument('--name', default='exp', help='save to project/name')
    p.add_argument('--exist-ok', action='store_true', help='existing project/name ok, do not increment')
    p.add_argument('--quad', action='store_true', help='quad dataloader')
    p.add_argument('--cos-lr', action='store_true', help='cosine LR scheduler')
    p.add_argument('--flat-cos-lr', action='store_true', help='flat cosine LR scheduler')
    p.add_argument('--fixed-lr', action='store_true', help='fixed LR scheduler')
    p.add_argument('--label-smoothing', type=float, default=0.0, help='Label smoothing epsilon')
    p.add_argument('--patience', type=int, default=100, help='EarlyStopping patience (epochs without improvement)')
    p.add_argument('--freeze', nargs='+', type=int, default=[0], help='Freeze layers: backbone=10, first3=0 1 2')
    p.add_argument('--save-period', type=int, default=-1, help='Save checkpoint every x epochs (disabled if < 1)')
    p.add_argument('--seed', type=int, default=0, help='Global training seed')
    p.add_argument('--local_rank', '--local-rank', type=int, default=-1,
                   help='set by python -m torch.distributed.launch; torchrun sets LOCAL_RANK instead')
    p.add_argument('--min-items', type=int, default=0, help='Experimental')
    p.add_argument('--close-mosaic', type=int, default=0, help='Experimental')
    p.add_argument('--entity', default=None, help='Entity')
    p.add_argument('--upload_dataset', nargs='?', const=True, default=False, help='Upload data, "val" option')
    p.add_argument('--bbox_interval', type=int, default=-1, help='Set bounding-box image logging interval')
    p.add_argument('--artifact_alias', type=str, default='latest', help='Version of dataset artifact to use')
    # -- the kit's own flags ---------------------------------------------------------------------------------------
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
    kit.add_argument('--channels-last', action='store_true',
                     help='train in channels-last (NHWC) memory format (measured in bench/RESULTS.md)')
    kit.add_argument('--compile', action='store_true',
                     help='torch.compile the model (slow first steps; measured in bench/RESULTS.md)')
    kit.add_argument('--demo-dir', type=Path, default=None,
                     help='where the demo dataset is generated when --data is not given '
                          '(default: PROJECT/../demo-data)')
    return p


def parse_args(argv, root: Path):
    opt = build_parser(root).parse_args(argv)
    opt.hyp, opt.project = str(opt.hyp), str(opt.project)
    return opt


def uses_demo(opt) -> bool:
    return opt.data is None


def check_options(opt, world_size: int):
    """Reject what cannot work, identically on every rank (so all stop together, before any collective)."""
    ddp = world_size > 1
    if opt.evolve:
        raise UsageError('--evolve is not supported by ddp_train_dual.py; run hyperparameter evolution with '
                         'train_dual.py (patched by the kit, it works on one process)')
    if ddp and opt.image_weights:
        raise UsageError('--image-weights is not compatible with DDP (each rank would draw other images); '
                         'train on one process or drop the flag')
    if ddp and opt.batch_size == -1:
        raise UsageError('AutoBatch (--batch-size -1) is not compatible with DDP; pass a --batch-size')
    if ddp and opt.batch_size % world_size:
        raise UsageError(f'--batch-size {opt.batch_size} is not a multiple of the {world_size} processes; '
                         f'use a multiple of {world_size}')
    if opt.batch_size < -1 or opt.batch_size == 0:
        raise UsageError(f'--batch-size {opt.batch_size} is not a batch size')
    if opt.epochs < 1:
        raise UsageError(f'--epochs {opt.epochs}: train for at least one epoch')
    if opt.ddp_timeout <= 0:
        raise UsageError('--ddp-timeout must be a positive number of seconds')
    try:
        levers_for(opt)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if opt.resume and opt.auto_resume:
        raise UsageError('give either --resume or --auto-resume, not both')
    for flag in ('data', 'hyp', 'weights'):
        value = getattr(opt, flag)
        if value and not opt.resume and not str(value).startswith(('http://', 'https://')) \
                and not Path(value).is_file():
            raise UsageError(f'--{flag} {value}: no such file')
