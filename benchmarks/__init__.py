"""Benchmarks: each module ``benchmarks/<name>.py`` defines ``main() -> dict`` and writes its results to
``experiments/results/<name>.json`` with the date and machine."""
