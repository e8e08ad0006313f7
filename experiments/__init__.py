"""Named experiments, the launcher and benchmarks."""
