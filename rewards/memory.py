"""What scoring an image costs in memory, so that servers and ``flowrl score`` can bound it.

A reward's working memory grows with the pixels it is given: the decoded image, its float32 copy
``[B, 3, H, W]`` (12 bytes per pixel), and whatever the reward computes per pixel (the ``shapes``
reward's colour fit holds six float64 planes and their residuals: about 610 bytes per pixel in all). Rewards
that resize to a fixed input (CLIP-style models) cost only the conversion per pixel; their activations
are a per-image constant bounded by the batch size.

:data:`MEASURED_BYTES_PER_PIXEL` holds the peak resident memory per input pixel of each bundled reward,
measured with :func:`measure_bytes_per_pixel` (a fresh process scores one 1024x1024 PNG-decoded image
after a warm-up; the kernel's peak-RSS counter is reset just before, so model loading does not count).
The figures include decoding the image and converting it to a tensor, and carry a 25% margin. A reward
that declares ``bytes_per_pixel`` itself overrides the table; an unknown reward gets the conservative
:data:`DEFAULT_BYTES_PER_PIXEL`. Composed rewards run their parts one after another on the same input,
so they cost their most expensive part.

Re-measure after changing a reward: ``python -m rewards.memory shapes jpeg_compressibility``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["MEASURED_BYTES_PER_PIXEL", "DEFAULT_BYTES_PER_PIXEL", "DECODE_BYTES_PER_PIXEL", "bytes_per_pixel",
           "max_pixels_for", "measure_bytes_per_pixel", "format_bytes"]

# Peak bytes per input pixel (x1.25 margin, rounded up to 8), measured on 2026-12-01 with
# `python -m rewards.memory` (1024x1024 image, 1 thread, CPU). Tiny model configs stand in for the
# CLIP-family rewards: their per-pixel cost is the preprocessing, which does not depend on model size.
# Measured (1024x1024 / 512x512): shapes 614 / 610, ocr 816 / 768, jpeg_* 68 / 64, vlm_judge (tiny LLaVA)
# 56 / 63, pickscore 44 / 40, hpsv2 43 / 36, clip_score 40 / 39, aesthetic 40 / 36.
MEASURED_BYTES_PER_PIXEL: dict[str, float] = {
    "shapes": 768.0,
    "ocr": 1024.0,
    "jpeg_compressibility": 88.0,
    "jpeg_incompressibility": 88.0,
    "vlm_judge": 80.0,
    "pickscore": 56.0,
    "hpsv2": 56.0,
    "clip_score": 56.0,
    "aesthetic": 56.0,
}

# An unmeasured reward is assumed to cost this much (more than every measured one).
DEFAULT_BYTES_PER_PIXEL = 1280.0

# Decoding a PNG into an RGB PIL image before the reward sees it (RGBA or palette sources convert
# through a second buffer): counted by servers for images waiting in their queue.
DECODE_BYTES_PER_PIXEL = 8.0


def bytes_per_pixel(reward: Any) -> float:
    """Peak working memory per input pixel of ``reward`` (a Reward, possibly composed)."""
    declared = getattr(reward, "bytes_per_pixel", None)
    if declared is not None:
        return float(declared)
    parts = []
    if hasattr(reward, "terms"):  # WeightedSum
        parts = [term[1] for term in reward.terms]
    elif hasattr(reward, "alignment") and hasattr(reward, "quality"):  # GatedReward
        parts = [reward.alignment, reward.quality]
    elif hasattr(reward, "transforms") and hasattr(reward, "reward"):  # TransformedReward
        parts = [reward.reward]
    if parts:
        return max(bytes_per_pixel(part) for part in parts)
    return float(MEASURED_BYTES_PER_PIXEL.get(getattr(reward, "name", ""), DEFAULT_BYTES_PER_PIXEL))


def max_pixels_for(reward: Any, budget_bytes: int, cap: int | None = None) -> int:
    """The most pixels one image may have so that scoring it stays within ``budget_bytes``."""
    limit = int(budget_bytes // (bytes_per_pixel(reward) + DECODE_BYTES_PER_PIXEL))
    return max(1, min(limit, cap) if cap is not None else limit)


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``; binary units, one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


_PROBE = r"""
import gc, io, json, re, sys
import numpy as np, torch
torch.set_num_threads(1)
from PIL import Image
import rewards

spec, kwargs, size = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
reward = rewards.load(spec, **kwargs) if kwargs else rewards.build_reward(spec)
prompt = sys.argv[4]

def png(side):
    rng = np.random.default_rng(0)
    coarse = rng.random((8, 8, 3)) * 255
    image = Image.fromarray(coarse.astype(np.uint8)).resize((side, side), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()

def decode(data):
    image = Image.open(io.BytesIO(data), formats=["PNG"])
    image.load()
    return image.convert("RGB")

def hwm_kib():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))

def rss_kib():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1))

with torch.no_grad():
    reward([decode(png(64))], [prompt])  # warm-up: lazy imports, first-call allocations
    data = png(size)
    gc.collect()
    before = rss_kib()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset the peak-RSS counter (Linux >= 4.0)
    reward([decode(data)], [prompt])
    peak = hwm_kib()
print(json.dumps({"peak_minus_before_bytes": (peak - before) * 1024, "pixels": size * size}))
"""


def measure_bytes_per_pixel(spec: str, *, size: int = 1024, kwargs: dict | None = None,
                            prompt: str = "a red circle") -> float:
    """Peak resident bytes per pixel of decoding one ``size x size`` PNG and scoring it, measured in a
    fresh process (Linux only: it reads and resets ``/proc/self`` counters).

    Args:
        spec: a reward name or composition string (``"shapes"``, ``"pickscore,aesthetic"``).
        size: the image side in pixels.
        kwargs: keyword arguments of a single reward (e.g. a tiny model's path).
        prompt: the prompt it is scored against.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run([sys.executable, "-c", _PROBE, spec, json.dumps(kwargs or {}), str(size), prompt],
                          capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {spec!r} failed: {done.stderr.strip().splitlines()[-1:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["peak_minus_before_bytes"] / result["pixels"]


if __name__ == "__main__":
    names = sys.argv[1:] or ["shapes", "jpeg_compressibility", "jpeg_incompressibility"]
    for name in names:
        print(f"{name}: {measure_bytes_per_pixel(name):.1f} bytes per pixel", flush=True)
