"""Benchmarks: print measured figures and ratios from one run; never part of the tests."""
