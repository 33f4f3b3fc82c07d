"""Laboratory tools beside the benchmarks (run as `python -m lab.bench.NAME` from the repository root)."""
