"""The GPU benchmarks of the kit (docs/benchmarks.md); importable so that tests and scripts share its modules."""
