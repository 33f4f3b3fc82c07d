"""Benchmarks of ssmquant: one runner (`python benchmarks/run.py list`), a registry of benchmarks (one module each),
raw results in benchmarks/results/ (git-ignored) and the current table of each in benchmarks/RESULTS.md."""
