"""``python -m flowrl.testing KIND DIR``: write a tiny pipeline of family KIND (sd3, flux, qwen_image) to DIR,
offline (a stand-in for the real weights: same structure, random weights, 64 px; see
flowrl/testing/tiny_pipelines.py)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from flowrl.testing import TINY_FAMILIES, build_tiny

    kinds = ("sd3", "flux", *TINY_FAMILIES)
    if len(argv) != 2 or argv[0] not in kinds:
        print(f"usage: python -m flowrl.testing {'|'.join(kinds)} DIR", file=sys.stderr)
        return 2
    path = build_tiny(argv[0], argv[1])
    print(f"wrote a tiny {argv[0]} pipeline to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
