"""What this machine's CPU can do fast, for settings that only pay with hardware support.

:func:`native_bfloat16` tells whether bfloat16 dot products run in hardware; :func:`check_bfloat16` turns a
bfloat16 setting on a CPU without it into a config error naming the setting and the fix (training, ``flowrl
sample`` / ``eval``); :mod:`flowrl.calibration` probes in float32 there and :mod:`flowrl.dryrun` switches its tiny
epoch to float32.
"""

from __future__ import annotations

import torch

__all__ = ["native_bfloat16", "check_bfloat16"]


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX, what oneDNN's bf16 kernels need).

    Without it, ``torch.autocast("cpu", dtype=torch.bfloat16)`` still runs, by conversion, about 30x slower than
    float32 (measured 2026-12-04 on a 2-core AVX2 AMD EPYC: a shapes-UNet forward of 32 images took 21.5 s under
    bf16 autocast and 0.70 s in float32)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: ask the CPU flags torch reads
        return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


def check_bfloat16(precision: str, device: torch.device | str, key: str) -> None:
    """Refuse bfloat16 autocast where it is a slowdown: on a CPU without :func:`native_bfloat16`.

    Raises:
        ConfigError: ``precision`` is ``bfloat16``, ``device`` is a CPU and the CPU has no bf16 hardware (the
            message names the setting and the fix).
    """
    from flowrl.config import ConfigError

    if precision == "bfloat16" and torch.device(device).type == "cpu" and not native_bfloat16():
        capability = torch.backends.cpu.get_cpu_capability()
        raise ConfigError(key, f"bfloat16 on this CPU ({capability}, no AVX512-BF16 or AMX) is emulated and runs "
                          f"about 30x slower than float32; set {key}=float32 (bfloat16 pays on CPUs with bf16 "
                          "dot products and on GPUs)")
