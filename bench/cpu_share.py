#!/usr/bin/env python3
"""Where a training's CPU goes over a window: each thread of the training process and the total of its children
(the loader workers), as a share of one core. Read from /proc at the window's start and end, so it costs the
training nothing.

    python3 bench/cpu_share.py PID SECONDS OUT.json
"""
import json
import os
import sys
import time
from pathlib import Path

TICKS = os.sysconf('SC_CLK_TCK')


def cpu_seconds(stat_file: Path) -> float:
    fields = stat_file.read_text().rsplit(') ', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime and stime, fields 14 and 15 of proc(5)


def threads_of(pid: int) -> dict:
    """{'NAME TID': CPU seconds} of each thread of pid."""
    seconds = {}
    for task in Path(f'/proc/{pid}/task').iterdir():
        try:
            name = (task / 'comm').read_text().strip()
            seconds[f'{name} {task.name}'] = cpu_seconds(task / 'stat')
        except OSError:  # the thread ended
            pass
    return seconds


def children_of(pid: int) -> dict:
    """{pid: CPU seconds} of each child of pid (the loader workers and pin-memory helpers)."""
    seconds = {}
    for task in Path(f'/proc/{pid}/task').iterdir():
        for child in (task / 'children').read_text().split():
            try:
                seconds[int(child)] = cpu_seconds(Path(f'/proc/{child}/stat'))
            except OSError:
                pass
    return seconds


def shares(before: dict, after: dict, seconds: float) -> dict:
    return {key: round((after[key] - before[key]) / seconds, 3) for key in after if key in before}


def main():
    pid, window, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    started = time.monotonic()
    threads, children = threads_of(pid), children_of(pid)
    time.sleep(window)
    elapsed = time.monotonic() - started
    thread_shares = shares(threads, threads_of(pid), elapsed)
    child_shares = shares(children, children_of(pid), elapsed)
    busiest = dict(sorted(thread_shares.items(), key=lambda item: -item[1])[:8])
    report = {'window_s': round(elapsed, 2), 'training_process_cores': round(sum(thread_shares.values()), 2),
              'busiest_threads': busiest, 'workers': len(child_shares),
              'workers_cores': round(sum(child_shares.values()), 2), 'cpus': os.cpu_count()}
    Path(out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == '__main__':
    main()
