#!/usr/bin/env python3
"""Apply the yolov9-ddp patch series to a YOLOv9 clone, check it, report on it, or take it back out.

  python apply_patches.py TARGET             verify TARGET against the pin, apply the series, install the kit
  python apply_patches.py TARGET --check     dry run; exit 0 if apply would succeed or has nothing to do
  python apply_patches.py TARGET --status    what is applied and installed
  python apply_patches.py TARGET --revert    restore the pinned bytes and remove the installed kit files
  python apply_patches.py --refresh CLONE    rewrite patches/ from the commits on top of the pin in CLONE
  python apply_patches.py --commits CLONE    apply the series to CLONE as one commit per patch (to edit them)

Exit status: 0 done (or nothing to do), 1 refused or failed (the tree is left as it was),
2 bad command line, 3 (--check only) the tree is another upstream revision but every patch still applies.
"""
import argparse
import json
import signal
import sys
from pathlib import Path

from patchkit.applier import EXIT_FAILED, EXIT_OK, Applier
from patchkit.pin import PinError, read_pin
from patchkit.refresh import apply_as_commits, refresh
from patchkit.series import SeriesError, read_series
from patchkit.tree import TreeError

STATUS_MARKS = {'clean': 'ok', 'offset': 'ok (offset)', 'upstream': 'already upstream', 'fuzz': 'DRIFT (fuzz)',
                'conflict': 'CONFLICT', 'missing': 'MISSING FILE'}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     epilog=__doc__.split('\n\n', 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('target', nargs='?', type=Path, help='root folder of a YOLOv9 clone or copy')
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument('--check', action='store_true', help='dry run: would the series apply?')
    mode.add_argument('--status', action='store_true', help='report what is applied and installed')
    mode.add_argument('--revert', action='store_true', help='take the series and the installed files back out')
    mode.add_argument('--refresh', metavar='CLONE', type=Path, help='regenerate patches/ from commits in CLONE')
    mode.add_argument('--commits', metavar='CLONE', type=Path, help='apply the series to CLONE as commits')
    parser.add_argument('--json', action='store_true', help='print a machine-readable report on stdout')
    args = parser.parse_args(argv)
    maintainer_mode = args.refresh or args.commits
    if maintainer_mode and args.target:
        parser.error('--refresh and --commits take a clone, not a TARGET')
    if not maintainer_mode and not args.target:
        parser.error('give the TARGET folder (a YOLOv9 clone)')
    return args


def print_report(report, log):
    log(f"{report['target']}: {report['state']} (pin {report['pin'][:7]}); {report.get('action', '')}".rstrip('; '))
    for patch in report.get('drift') or report['patches']:
        status = STATUS_MARKS.get(patch['status'], patch['status'])
        detail = patch.get('detail', '')
        if patch.get('mismatch_line'):
            detail = (f"{patch['file']} hunk {patch['hunk']}, line {patch['mismatch_line']}: expected "
                      f"{patch['expected_text'].strip()!r}, found {patch['found_text'].strip()!r}")
        log(f"  {patch['name']:<64} {status}{'  ' + detail if detail else ''}")
    for f in report['files']:
        if not f['matches'] and report['state'] not in ('applied', 'partial'):
            log(f"  {f['path']}: blob {f['found'] or '(missing)'}, pinned {f['expected']}")
    for f in report.get('installed', []):
        if isinstance(f, dict):
            log(f"  installed {f['path']}: {f['status']}")


def run(args, log):
    pin = read_pin()
    if args.refresh:  # needs no series: it writes one
        refresh(args.refresh, pin, log=log)
        return None, EXIT_OK
    patches = read_series()
    if args.commits:
        apply_as_commits(args.commits, pin, patches, log=log)
        return None, EXIT_OK
    applier = Applier(args.target, pin, patches, log=log)
    operation = applier.check if args.check else applier.status if args.status else \
        applier.revert if args.revert else applier.apply
    return operation()


def interrupt(signum, frame):
    raise KeyboardInterrupt  # unwinds through the journal, which puts the tree back


def main(argv=None):
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    # With --json, stdout carries only the JSON document; progress goes to stderr.
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    try:
        report, code = run(args, log)
    except (TreeError, PinError, SeriesError) as e:
        print(f'apply_patches.py: error: {e}', file=sys.stderr)
        if getattr(e, 'hint', ''):
            print(f'apply_patches.py: hint: {e.hint}', file=sys.stderr)
        if args.json:
            print(json.dumps({'ok': False, 'error': str(e), 'hint': getattr(e, 'hint', '')}, indent=1))
        return EXIT_FAILED
    except KeyboardInterrupt:
        print('apply_patches.py: interrupted; the tree is as it was before this run', file=sys.stderr)
        return 130
    if report is not None:
        report['ok'] = code == EXIT_OK
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            print_report(report, log)
    return code


if __name__ == '__main__':
    sys.exit(main())
