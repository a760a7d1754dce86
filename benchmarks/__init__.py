"""Benchmarks: each module ``benchmarks/<name>.py`` defines ``main() -> dict`` and writes its results to
``benchmarks/results/<name>.json`` with the date and machine."""
