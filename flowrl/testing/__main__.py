"""``python -m flowrl.testing sd3|flux DIR``: write a tiny SD3 or FLUX pipeline to DIR, offline (a stand-in for
the real weights: same structure, random weights, 64 px; see flowrl/testing/tiny_pipelines.py)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("sd3", "flux"):
        print("usage: python -m flowrl.testing sd3|flux DIR", file=sys.stderr)
        return 2
    from flowrl.testing import build_tiny_flux, build_tiny_sd3

    path = (build_tiny_sd3 if argv[0] == "sd3" else build_tiny_flux)(argv[1])
    print(f"wrote a tiny {argv[0]} pipeline to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
