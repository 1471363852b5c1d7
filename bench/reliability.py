#!/usr/bin/env python3
"""How reliably ddp_train_dual.py survives faults: the fault scenarios of tests/test_faults.py (killed trainers and
loader workers, an exception or out-of-memory error on one rank, SIGTERM / SIGINT, a stalled rank, damaged or lost
checkpoints, a slow shared filesystem on resume), each run K times on CPU, as a Markdown table.

    python bench/reliability.py [--runs 3] [--tree PATCHED_TREE] [--only NAME,...] [--workdir DIR] [--json OUT]

Every run is a real job of 2 processes (torchrun, gloo; the SIGINT one is a single process) on the kit's tiny model
and a generated dataset of 48 + 16 images at 64 px, 3 epochs. The faults are injected by
testsupport/probes/faulty_train.py and each scenario is the function of testsupport/faults.py that the tests assert
on, so a row here counts exactly what the test checks. Columns:

  ended correctly   the run ended as the scenario requires: a completing scenario with every epoch in one run folder,
                    run.json finished, last.pt loadable and stripped, no temporary files, every checkpoint seen while
                    training loadable; a refusing scenario with one error line, no training, weights/ untouched;
                    a failing one promptly with one error line naming the cause, no process of the job left
  epochs re-run     per fault: the epoch in progress at the fault - the epoch training next started at + 1
                    (1 = only the epoch in progress was lost); the largest over all runs

Without --tree, the pinned upstream is taken from the tests' cache ($YOLOV9_DDP_CACHE, else ~/.cache/yolov9-ddp)
or rebuilt from PyPI wheels there, and patched with apply_patches.py into the work folder.
"""
import argparse
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import date
from pathlib import Path

KIT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(KIT))

import testsupport.faults as h  # noqa: E402
from testsupport import trees  # noqa: E402
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset  # noqa: E402

SPEC = DemoSpec(train=48, val=16, imgsz=64)
COMPLETES, REFUSES, FAILS = 'completes every epoch', 'refused: one error line, nothing written', \
    'fails fast, one error line, no process left'


def scenarios():
    """name -> (claim, expected end, function(tree, data, workdir) -> testsupport.faults.Outcome)."""
    table = {}
    for name, fault in h.KILL_FAULTS.items():
        table[f'SIGKILL {name}'] = ('1', COMPLETES, lambda t, d, w, f=fault: h.kill_scenario(t, d, w, f))
    for name, fault in h.WORKER_KILL_FAULTS.items():
        table[f'SIGKILL loader {name}'] = (
            '1', COMPLETES, lambda t, d, w, f=fault: h.kill_scenario(t, d, w, f, extra=h.WORKERS))
    table['SIGKILL a random process of the job at a random moment'] = (
        '1', COMPLETES, lambda t, d, w: h.random_kill_scenario(t, d, w, seed=random.randrange(2 ** 32)))
    for name, (fault, fragments) in h.RAISE_FAULTS.items():
        table[f'{name} on one rank, no restarts'] = (
            '1', FAILS, lambda t, d, w, f=fault, words=fragments: h.failure_scenario(t, d, w, f, words))
    table['an exception in the loss on one rank, --max-restarts 1'] = (
        '1', COMPLETES, lambda t, d, w: h.kill_scenario(t, d, w, h.RAISE_FAULTS['in the loss'][0], max_restarts=1,
                                                        extra=h.WORKERS))
    table['SIGTERM to torchrun, --save-on-signal, then --resume'] = (
        '2', COMPLETES, lambda t, d, w: h.signal_scenario(t, d, w, signal.SIGTERM, save_on_signal=True))
    table['SIGTERM to torchrun, then --resume'] = (
        '2', COMPLETES, lambda t, d, w: h.signal_scenario(t, d, w, signal.SIGTERM, save_on_signal=False))
    table['SIGINT to one process, then --resume'] = (
        '2', COMPLETES, lambda t, d, w: h.signal_scenario(t, d, w, signal.SIGINT, save_on_signal=False, nproc=1))
    table['rank 1 hangs, --ddp-timeout 10'] = (
        '3', FAILS, lambda t, d, w: h.stall_scenario(t, d, w, max_restarts=0))
    table['rank 1 hangs, --ddp-timeout 10, --max-restarts 1'] = (
        '3', COMPLETES, lambda t, d, w: h.stall_scenario(t, d, w, max_restarts=1))
    table['truncated last.pt, last.previous.pt kept'] = (
        '4a', COMPLETES, lambda t, d, w: h.fallback_scenario(t, d, w))
    for how, claim in (('truncated', '4b'), ('garbage', '4c')):
        table[f'{how} last.pt, no previous'] = (
            claim, REFUSES, lambda t, d, w, how=how: h.refused_checkpoint_scenario(t, d, w, how))
    table['last.pt of another model'] = (
        '4d', REFUSES, lambda t, d, w: h.refused_checkpoint_scenario(t, d, w, 'another-model', keep_previous=True))
    for via in ('auto-resume', 'torchrun-restart'):
        table[f'checkpoints lost, {via}'] = (
            '4e', REFUSES, lambda t, d, w, via=via: h.lost_checkpoints_scenario(t, d, w, via))
    table['--resume on a slow shared filesystem'] = (
        '4f', COMPLETES, lambda t, d, w: h.slow_filesystem_resume_scenario(t, d, w))
    return table


def patched_tree(workdir: Path) -> Path:
    """A copy of the verified pinned upstream (the tests' cache, or a wheel rebuild) with the kit applied."""
    tree = trees.copy_tree(trees.pinned_upstream_root(), workdir / 'yolov9')
    result = trees.run_applier(tree)
    assert result.returncode == 0, trees.describe(result)
    return tree


def run_once(function, tree, data, workdir) -> dict:
    """One run of a scenario: whether it ended correctly, epochs re-run per fault, why not, seconds, details."""
    started = time.monotonic()
    try:
        outcome = function(tree, data, workdir)
        result = {'ok': not outcome.problems, 'redone': outcome.redone, 'why': '; '.join(outcome.problems)[:600],
                  'detail': outcome.detail}
    except AssertionError as e:  # a deadline passed, or the scenario's set-up failed
        result = {'ok': False, 'redone': [], 'why': str(e).splitlines()[0][:300]}
    except Exception:  # noqa: BLE001 - a crash of the scenario is a failed run, reported with its traceback
        result = {'ok': False, 'redone': [], 'why': traceback.format_exc(limit=3)[-600:]}
    return {**result, 'seconds': round(time.monotonic() - started, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--runs', type=int, default=3, help='runs per scenario (default 3)')
    parser.add_argument('--tree', type=Path, help='a YOLOv9 tree patched by apply_patches.py (default: make one)')
    parser.add_argument('--only', default='', help='comma-separated substrings of scenario names to run')
    parser.add_argument('--workdir', type=Path, help='where jobs run (default: a temporary folder, removed)')
    parser.add_argument('--json', type=Path, help='also write every run as JSON here')
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix='yolov9-ddp-reliability-'))
    workdir.mkdir(parents=True, exist_ok=True)
    tree = args.tree.resolve() if args.tree else patched_tree(workdir)
    sys.path.insert(0, str(tree))  # checkpoints pickle upstream's classes
    data = ensure_demo_dataset(workdir / 'demo', SPEC, log=lambda msg: None)
    chosen = {name: row for name, row in scenarios().items()
              if not args.only or any(part.strip() in name for part in args.only.split(','))}

    rows, report = [], {}
    for name, (claim, expected, function) in chosen.items():
        runs = []
        for k in range(args.runs):
            slug = ''.join(c if c.isalnum() else '-' for c in name.lower())[:60]
            run = run_once(function, tree, data, workdir / slug / f'run{k}')
            runs.append(run)
            print(f'{name} #{k + 1}: {"ok" if run["ok"] else "FAILED: " + run["why"]} ({run["seconds"]:.0f} s)',
                  file=sys.stderr, flush=True)
        report[name] = runs
        redone = [r for run in runs for r in run['redone']]
        worst = str(max(r for r in redone if r is not None)) if expected == COMPLETES and any(redone) else '-'
        seconds = sorted(run['seconds'] for run in runs)[len(runs) // 2]
        rows.append(f'| {claim} | {name} | {expected} | {len(runs)} | {sum(r["ok"] for r in runs)} | {worst} '
                    f'| {seconds:.0f} |')

    print(f'\nbench/reliability.py --runs {args.runs}, {date.today().isoformat()}, {platform.machine()}, '
          f'{os.cpu_count()} CPUs, torch {__import__("torch").__version__}\n')
    print('| claim | scenario | expected end | runs | ended correctly | epochs re-run per fault (max) | s per run |')
    print('|---|---|---|---|---|---|---|')
    print('\n'.join(rows))
    failures = [(name, k, run['why']) for name, runs in report.items() for k, run in enumerate(runs) if not run['ok']]
    if failures:
        print('\nWhy runs did not end correctly:\n')
        for name, k, why in failures:
            print(f'- {name} #{k + 1}: {why}')
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if not failures else 1


if __name__ == '__main__':
    sys.exit(main())
