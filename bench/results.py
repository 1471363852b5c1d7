#!/usr/bin/env python3
"""The benchmark's targets, computed from alternating pairs, and bench/results.json, where the calls' figures land.

    python bench/results.py merge CALL_RESULTS.json... [--into bench/results.json]

Every target is the median of the ratios of at least MIN_PAIRS pairs (A, B) run alternately in one call (A, B,
A, B, ...): one machine differs from the next by up to 44% on the same command, a ratio within a pair much
less. A call's results.json holds its pairs (every figure of every run) and the targets they give. Merging a
GPU call puts its pairs at the top of bench/results.json (a later call of the same comparison replaces an earlier
one) and recomputes "targets" from all pairs there; a dry run (CPU) lands under "dry_run" and never touches them.
"""
import argparse
import json
import statistics
from pathlib import Path

MIN_PAIRS = 3
TARGETS = {  # key, for N GPUs (the keys name 2 GPUs where N is 2) -> what its ratio is
    'per_gpu_vs_upstream_{n}gpu': "kit img/s per GPU / upstream train_dual.py's, both on N GPUs, same global batch "
                                  "and data (second epoch, from results.csv)",
    'scaling_{n}gpu': 'kit img/s on N GPUs / kit img/s on 1 GPU, 32 images per GPU (second epoch, from results.csv)',
    'val_{n}gpu_vs_rank0': 'seconds of distributed validation on N GPUs / of rank-0 validation (metrics identical)',
    'parity_map50_95_points': '|mAP50-95 difference| in points, the larger median of: 1 GPU against N GPUs, and '
                              "the kit's defaults against upstream's numerics (same seed within a pair)",
    'ram_cache_{n}ranks_vs_1rank': 'node memory holding the --cache ram images with N ranks / with 1 rank',
}
# the one-GPU targets: keys of their own beside the N-GPU ones above
ONE_GPU_TARGETS = {
    'per_gpu_vs_upstream_1gpu': "kit img/s / upstream train_dual.py's, 1 GPU, same data (second epoch, from "
                                'results.csv)',
    'in_loop_vs_gpu_only_1gpu': "kit img/s in its training loop (its 'epoch 1' log line) / its GPU-only step on a "
                                'batch already on the GPU, same levers, 1 GPU',
    'deterministic_vs_upstream_1gpu': "kit img/s with --deterministic / upstream train_dual.py's, 1 GPU (second "
                                      'epoch, from results.csv)',
    'checkpoint_minutes_1_vs_none_1gpu': 'kit img/s with a step checkpoint every minute / without, 1 GPU',
    'short_job_vs_upstream_1gpu': "upstream train_dual.py's seconds for a whole fine-tune (6 epochs of 512 images, "
                                  "batch 16, validation every epoch) / the kit's, 1 GPU",
    'first_epoch_vs_upstream_1gpu': "upstream's seconds from launch to its first results.csv row / the kit's, the "
                                    'same fine-tune',
    'peak_memory_vs_upstream_b16_1gpu': "the kit's peak GPU memory (nvidia-smi) / upstream's, the same fine-tune "
                                        '(batch 16)',
    'peak_memory_vs_upstream_b32_1gpu': "the kit's peak GPU memory (nvidia-smi) / upstream's, batch 32 (per-gpu)",
    'fits_where_upstream_fits_1gpu': "1 where the kit completed with GPU memory left free for upstream's peak + 15% "
                                     '(a ballast process holds the rest), 0 where not; pairs where upstream '
                                     'completed (the fits call, batch 32)',
    'shared_node_epochs_vs_upstream': "epochs the kit's runs completed / upstream's, 4 single-GPU runs of each side "
                                      'at once on one GPU for the same seconds (the shared-node call)',
    'epoch_end_beyond_validation_s_1gpu': "not a ratio: the median of the kit's epoch end minus its validation, in "
                                          "seconds (its 'epoch N:' log lines), the same fine-tune",
}
PARITY = 'parity_map50_95_points'
# results.json's N-GPU "targets" are named for 2 GPUs; a call on another number of GPUs adds its pairs under
# its own keys (per_gpu_vs_upstream_1gpu, ...), and only its GPU-count-free one (parity) counts towards the targets
TARGET_GPUS = 2


def target_keys(n: int) -> list:
    return [key.format(n=n) for key in TARGETS]


def median_ratio(series: dict):
    ratios = [pair['ratio'] for pair in series.get('pairs', []) if pair.get('ratio') is not None]
    return round(statistics.median(ratios), 4) if ratios else None


def targets_from(pairs: dict, n: int) -> dict:
    """Every target key for N GPUs: the median ratio of its pairs, None where none were run. The parity target has
    two series ('parity_map50_95_points/...'): it is the larger of their medians."""
    targets = {key: median_ratio(pairs[key]) if key in pairs else None for key in target_keys(n)}
    parity = [median_ratio(series) for key, series in pairs.items() if key.startswith(PARITY + '/')]
    parity = [m for m in parity if m is not None]
    targets[PARITY] = max(parity) if parity else None
    return targets


def one_gpu_targets(pairs: dict) -> dict:
    """The one-GPU targets: the median ratio of each key's pairs, None where none were run."""
    return {key: median_ratio(pairs[key]) if key in pairs else None for key in ONE_GPU_TARGETS}


def checkpoint_key(minutes: float, n: int) -> str:
    return f'checkpoint_minutes_{minutes:g}_vs_none_{n}gpu'


def checkpoint_what(minutes: float, measured: str) -> str:
    return f'kit img/s with a periodic checkpoint every {minutes:g} minutes ({minutes * 60:g} s) / without, {measured}'


def summarise(series: dict) -> dict:
    """A series of pairs with its median and whether it has the pairs a target needs."""
    ok = [p for p in series['pairs'] if p.get('ratio') is not None]
    return {**series, 'median': median_ratio(series), 'complete': len(ok) >= MIN_PAIRS,
            'spread': [min(p['ratio'] for p in ok), max(p['ratio'] for p in ok)] if ok else None}


def merge(call: dict, into: dict) -> dict:
    """A call's results into bench/results.json's content: GPU figures at the top, a dry run under "dry_run"."""
    section = into if call['mode'] == 'gpu' else into.setdefault('dry_run', {})
    if call['mode'] != 'gpu':
        section['note'] = ('figures of a dry run on CPUs (gloo, tiny sizes): they prove the harness end to end, '
                           'they measure nothing; the targets above are the GPU calls\' only')
    section['mode'] = call['mode']
    section.setdefault('calls', []).extend(call['calls'])
    section.setdefault('machines', {}).update({c['call']: call['machine'] for c in call['calls']})
    section.setdefault('datasets', {}).update(call.get('datasets', {}))
    section.setdefault('pairs', {}).update(call['pairs'])
    section.setdefault('entry_points', {}).update(call.get('entry_points', {}))
    section['targets'] = {**targets_from(section['pairs'], TARGET_GPUS), **one_gpu_targets(section['pairs'])}
    return into


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest='command', required=True)
    m = sub.add_parser('merge')
    m.add_argument('calls', type=Path, nargs='+')
    m.add_argument('--into', type=Path, default=Path(__file__).resolve().parent / 'results.json')
    args = p.parse_args()
    content = json.loads(args.into.read_text()) if args.into.exists() else {}
    calls = [json.loads(path.read_text()) for path in args.calls]
    for call in calls:
        content = merge(call, content)
    args.into.write_text(json.dumps(content, indent=1) + '\n')
    section = content if all(call['mode'] == 'gpu' for call in calls) else content['dry_run']
    print(json.dumps(section['targets'], indent=1))


if __name__ == '__main__':
    main()
