"""``python -m benchmarks [NAME ...]``: run the benchmarks (all by default) and print their results."""

from __future__ import annotations

import importlib
import json
import sys
import time

BENCHMARKS = ["shapes_speed", "sampler_overhead", "rewards_bench", "reward_server"]


def main(argv: list[str]) -> int:
    names = argv or BENCHMARKS
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; valid: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    for name in names:
        start = time.time()
        print(f"== {name}", flush=True)
        result = importlib.import_module(f"benchmarks.{name}").main()
        print(json.dumps(result, indent=2, default=str))
        print(f"== {name}: {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
