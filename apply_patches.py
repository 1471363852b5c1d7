#!/usr/bin/env python3
"""Apply the yolov9-ddp patch series to a YOLOv9 clone, check it, report on it, or take it back out.

  python apply_patches.py TARGET             verify TARGET against the pin, apply the series, install the kit
  python apply_patches.py TARGET --check     dry run; exit 0 if apply would succeed or has nothing to do
  python apply_patches.py TARGET --status    what is applied and installed
  python apply_patches.py TARGET --revert    restore the files as they were before apply, remove the kit files
  python apply_patches.py --refresh CLONE    rewrite patches/ from the commits on top of the pin in CLONE
  python apply_patches.py --commits CLONE    apply the series to CLONE as one commit per patch (to edit them)

  --allow-other-revision   (with apply or --check) apply to a tree that is another upstream revision when
               every patch applies (clean, offset or already upstream); recorded in the target
  --json       (with TARGET) print the report as JSON on stdout; progress goes to stderr
  --markdown   (with --check) print the report as Markdown on stdout, for a CI job summary: a table of
               the patches (status, detail), the touched files whose blob id changed, a one-line verdict

Edits to touched files in a git clone of the pin, committed or not, are merged (3-way): a conflict is
refused with the file, the patch and its hunk named; --revert gives the edited files back. A tree patched by
an earlier kit version is upgraded by apply (its series taken out, this one applied) or reverted.
On a tree that is another upstream revision, --check replays the series on a scratch copy and reports each
patch: clean, offset (applies, moved), upstream (already contained: skipped), fuzz (applies only with
reduced context), conflict (file, hunk, first mismatching line) or missing (file deleted or renamed).

Exit status: 0 done (or nothing to do), 1 refused or failed (the tree is left as it was),
2 bad command line, 3 (--check only) the tree is another upstream revision but every patch still
applies (clean, offset or upstream); fuzz, conflict or missing give 1.
"""
import argparse
import json
import re
import signal
import sys
from pathlib import Path

from patchkit.applier import ALLOW_FLAG, EXIT_FAILED, EXIT_MOVED, EXIT_OK, Applier
from patchkit.pin import PinError, kit_version, read_pin
from patchkit.refresh import apply_as_commits, refresh
from patchkit.series import SeriesError, read_series
from patchkit.tree import TreeError

STATUS_MARKS = {'clean': 'ok', 'offset': 'ok (offset)', 'upstream': 'already upstream', 'fuzz': 'DRIFT (fuzz)',
                'conflict': 'CONFLICT', 'missing': 'MISSING FILE'}
VERDICTS = {EXIT_OK: 'pass', EXIT_MOVED: 'upstream moved, every patch still applies', EXIT_FAILED: 'fail'}
MARKDOWN_SPECIAL = re.compile(r'([\\`*_|<>\[\]])')


def parse_args(argv, prog):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split('\n\n')[0],
                                     epilog=__doc__.split('\n\n', 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('target', nargs='?', type=Path, help='root folder of a YOLOv9 clone or copy')
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument('--check', action='store_true', help='dry run: would the series apply?')
    mode.add_argument('--status', action='store_true', help='report what is applied and installed')
    mode.add_argument('--revert', action='store_true', help='take the series and the installed files back out')
    mode.add_argument('--refresh', metavar='CLONE', type=Path, help='regenerate patches/ from commits in CLONE')
    mode.add_argument('--commits', metavar='CLONE', type=Path, help='apply the series to CLONE as commits')
    parser.add_argument(ALLOW_FLAG, action='store_true', help='apply to another upstream revision when every patch '
                        'applies (no fuzz, no conflict)')
    parser.add_argument('--version', action='version', version=f'yolov9-ddp {kit_version()}')
    output = parser.add_mutually_exclusive_group()
    output.add_argument('--json', action='store_true', help='print a machine-readable report on stdout')
    output.add_argument('--markdown', action='store_true', help='with --check: print the report as Markdown')
    args = parser.parse_args(argv)
    maintainer_mode = args.refresh or args.commits
    if maintainer_mode and args.target:
        parser.error('--refresh and --commits take a clone, not a TARGET')
    if not maintainer_mode and not args.target:
        parser.error('give the TARGET folder (a YOLOv9 clone)')
    if args.markdown and not args.check:
        parser.error('--markdown renders the report of --check')
    if args.allow_other_revision and (args.status or args.revert or maintainer_mode):
        parser.error(f'{ALLOW_FLAG} goes with apply or --check')
    return args


# -- reports: the rows are computed once and rendered as text or as Markdown ----------------------

def patch_rows(report) -> list:
    """(patch, status, detail) per patch: its drift status where the tree was replayed, else applied or not."""
    rows = []
    for patch in report.get('drift') or report['patches']:
        detail = patch.get('detail', '')
        if patch.get('mismatch_line'):
            detail = (f"{patch['file']} hunk {patch['hunk']}, line {patch['mismatch_line']}: expected "
                      f"{patch['expected_text'].strip()!r}, found {patch['found_text'].strip()!r}")
        rows.append((patch['name'], STATUS_MARKS.get(patch['status'], patch['status']), detail))
    return rows


def changed_blobs(report) -> list:
    """Touched files whose blob id is not the pinned one (an applied tree differs by design: none listed)."""
    return [] if report['state'] == 'applied' else [f for f in report['files'] if not f['matches']]


def verdict(code) -> str:
    return f"{VERDICTS.get(code, 'fail')} (exit {code})"


def print_report(report, log):
    log(f"{report['target']}: {report['state']} (pin {report['pin'][:7]}); {report.get('action', '')}".rstrip('; '))
    for name, status, detail in patch_rows(report):
        log(f"  {name:<64} {status}{'  ' + detail if detail else ''}")
    for f in changed_blobs(report):
        log(f"  {f['path']}: blob {f['found'] or '(missing)'}, pinned {f['expected']}")
    for f in report.get('installed', []):
        if isinstance(f, dict):
            log(f"  installed {f['path']}: {f['status']}")


def md(text) -> str:
    """text as one Markdown table cell: literal, on one line."""
    return MARKDOWN_SPECIAL.sub(r'\\\1', str(text)).replace('\n', ' ')


def markdown_report(report, code) -> str:
    lines = [f"### yolov9-ddp check of {md(report['target'])}", '',
             f"Pinned upstream {report['pin'][:7]}; the touched files are **{report['state']}**.", '',
             '| patch | status | detail |', '|---|---|---|',
             *(f'| {md(name)} | {md(status)} | {md(detail)} |' for name, status, detail in patch_rows(report))]
    changed = changed_blobs(report)
    if changed:
        lines += ['', 'Touched files whose blob id differs from the pin:', '',
                  '| file | pinned blob | found |', '|---|---|---|',
                  *(f"| {md(f['path'])} | {f['expected']} | {f['found'] or 'missing'} |" for f in changed)]
    lines += ['', f"**Verdict: {verdict(code)}**: {md(report['action'])}"]
    return '\n'.join(lines)


def markdown_error(target, message) -> str:
    return f'### yolov9-ddp check of {md(target)}\n\n**Verdict: {verdict(EXIT_FAILED)}**: {md(message)}'


def run(args, log):
    pin = read_pin()
    if args.refresh:  # needs no series: it writes one
        refresh(args.refresh, pin, log=log)
        return None, EXIT_OK
    patches = read_series()
    if args.commits:
        apply_as_commits(args.commits, pin, patches, log=log)
        return None, EXIT_OK
    applier = Applier(args.target, pin, patches, log=log, allow_other_revision=args.allow_other_revision)
    if args.check:
        return applier.apply(dry_run=True)
    return (applier.status if args.status else applier.revert if args.revert else applier.apply)()


def interrupt(signum, frame):
    raise KeyboardInterrupt  # unwinds through the journal, which puts the tree back


def main(argv=None, prog='apply_patches.py'):
    args = parse_args(argv, prog)
    signal.signal(signal.SIGTERM, interrupt)
    # With --json or --markdown, stdout carries only that document; progress goes to stderr.
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json or args.markdown else print
    try:
        report, code = run(args, log)
    except (TreeError, PinError, SeriesError) as e:
        hint = getattr(e, 'hint', '')
        print(f'{prog}: error: {e}', file=sys.stderr)
        if hint:
            print(f'{prog}: hint: {hint}', file=sys.stderr)
        if args.json:
            print(json.dumps({'ok': False, 'exit': EXIT_FAILED, 'error': str(e), 'hint': hint}, indent=1))
        elif args.markdown:
            print(markdown_error(args.target, f'{e}. {hint}'.strip()))
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f'{prog}: interrupted; the tree is as it was before this run', file=sys.stderr)
        return 130
    if report is not None:
        report.update(ok=code == EXIT_OK, exit=code)
        if args.json:
            print(json.dumps(report, indent=1))
        elif args.markdown:
            print(markdown_report(report, code))
        else:
            print_report(report, log)
    return code


# The console command of an installed kit: `yolov9-ddp SUBCOMMAND ...` is `apply_patches.py ...` with these flags.
SUBCOMMANDS = {'apply': [], 'check': ['--check'], 'status': ['--status'], 'revert': ['--revert'],
               'refresh': ['--refresh'], 'commits': ['--commits']}


def console_main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (['--version'], ['-V']):
        print(f'yolov9-ddp {kit_version()}')
        return EXIT_OK
    if not argv or argv[0] not in SUBCOMMANDS:
        print(f'usage: yolov9-ddp {{{",".join(SUBCOMMANDS)}}} ARGS (the flags of apply_patches.py), or --version\n'
              f'yolov9-ddp: error: {"give a subcommand" if not argv else f"unknown subcommand {argv[0]!r}"}',
              file=sys.stderr)
        return 2
    return main(SUBCOMMANDS[argv[0]] + argv[1:], prog=f'yolov9-ddp {argv[0]}')


if __name__ == '__main__':
    sys.exit(main())
