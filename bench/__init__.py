"""The GPU benchmarks of the kit (bench/PLAN.md); importable so that tests and scripts share its modules."""
