"""Support code of the kit's tests and benchmarks, importable by both (bench/ never reaches into tests/).

trees.py   the verified pinned upstream, copies of trees and of the kit, snapshots, subprocess helpers
jobs.py    real torchrun jobs in a patched tree, the probes of probes/probe.py
faults.py  the fault scenarios of probes/faulty_train.py (tests/test_faults.py, bench/reliability.py)
forked.py  a job's Python processes forked from one that imported torch once: zygote.py, torchrun.py
"""
