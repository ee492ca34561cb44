"""Benchmarks and test benches for peerd (not installed with the package)."""
