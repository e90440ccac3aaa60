"""Benchmarks of the gateway and its engines, run from the repository root as modules
(`python -m bench.smc --help`), and the gateway launcher and load driver that the tests share
with them. Never shipped: it imports the shipped packages, and nothing from tests/."""
