"""What this machine can run: the device a run asks for (:func:`run_device`, :func:`no_cuda_reason`, and the guard
against a real-size model landing on the CPU by accident, :func:`check_not_silently_cpu`), and what its CPU can do
fast, for settings that only pay with hardware support.

:func:`native_bfloat16` tells whether bfloat16 dot products run in hardware; :func:`check_bfloat16` turns a
bfloat16 setting on a CPU without it into a config error naming the setting and the fix (training, ``flowrl
sample`` / ``eval``); :mod:`flowrl.run.calibration` probes in float32 there and :mod:`flowrl.commands.dryrun`
switches its tiny epoch to float32.
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import os

import torch

__all__ = ["native_bfloat16", "check_bfloat16", "DeviceError", "usable_device", "run_device", "resolve_device",
           "no_cuda_reason",
           "check_not_silently_cpu", "REAL_SIZE_PARAMETERS", "CUDA_DRIVER_FLOOR"]

#: The oldest NVIDIA driver each CUDA major version runs on (Linux; NVIDIA's CUDA toolkit release notes).
CUDA_DRIVER_FLOOR = {11: 450, 12: 525, 13: 580}
#: A model this large (parameters of the trained network) is not meant for a CPU: without an explicit
#: ``run.device=cpu`` a run that would put one there stops before loading it.
REAL_SIZE_PARAMETERS = 100_000_000


class DeviceError(FlowrlError, ValueError):
    """The device a run or command asks for cannot be used here, or it would silently be the CPU; the message names
    the cause and the setting that fixes it."""


def no_cuda_reason() -> str:
    """Why ``torch.cuda.is_available()`` is False here, as a reader can act on it (torch's build, the driver it
    needs, ``CUDA_VISIBLE_DEVICES``)."""
    built = torch.version.cuda
    if built is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build; install the CUDA build matching your driver "
                "(DEVELOPERS.md, 'torch')")
    floor = CUDA_DRIVER_FLOOR.get(int(built.split(".")[0]))
    need = f", which needs an NVIDIA driver >= {floor}" if floor else ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU" if visible is not None and not visible.strip() \
        else "no GPU is visible"
    return (f"torch {torch.__version__} is built for CUDA {built}{need}, and it finds no usable GPU: {hidden}, or "
            f"the driver is older than that (nvidia-smi prints its version), or none is installed")


def _registered_accelerator() -> str | None:
    """The name a Python backend registered for PrivateUse1 (the tests' fake accelerator), if any."""
    name = torch._C._get_privateuse1_backend_name()
    return None if name == "privateuseone" else name


def usable_device(text: str, setting: str) -> torch.device:
    """The device ``text`` names, if flowrl can run on it here: ``cpu``, ``cuda[:N]`` with that GPU present, ``mps``
    where Metal is available, or a registered Python backend (the tests' fake accelerator).

    Args:
        text: the device, e.g. ``cuda:1``.
        setting: what the user set, named in messages (``--device``, ``run.device``).

    Raises:
        DeviceError: not a torch device, or not usable here (the message says why and the fix).
    """
    usable = "cpu" + (", cuda" if torch.cuda.is_available() else "")
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise DeviceError(f"{setting} {text!r} is not a torch device; use {usable} (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cpu" or device.type == _registered_accelerator():
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"{setting} {text!r}: no CUDA device is available here ({no_cuda_reason()}); use "
                              f"{setting} cpu" if setting.startswith("--") else
                              f"{setting}={text}: no CUDA device is available here ({no_cuda_reason()}); set "
                              f"{setting}=cpu to run on the CPU")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"{setting} {text!r}: this machine has {count} CUDA device(s), cuda:0 to "
                              f"cuda:{count - 1}; use one of those")
        return device
    if device.type == "meta":
        raise DeviceError(f"{setting} {text!r}: meta tensors hold no data, so nothing can be generated or scored on "
                          f"them; use {usable}")
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"{setting} {text!r}: Apple's Metal (MPS) backend is not available on this machine; "
                              f"use {usable}")
        return device
    raise DeviceError(f"{setting} {text!r}: flowrl runs on cpu, cuda or mps, not {device.type}; use {usable}")


def run_device(text: str) -> torch.device | None:
    """The device ``run.device`` asks for: None for ``auto`` (accelerate's choice), else :func:`usable_device`."""
    return None if text == "auto" else usable_device(text, "run.device")


def check_not_silently_cpu(requested: str, device: torch.device, parameters: int | None, what: str) -> None:
    """Refuse a real-size model that landed on the CPU without ``run.device=cpu``: the only sign would be ``device
    cpu`` in the start-up line, and an SD3.5 run on a CPU is a day lost.

    Args:
        requested: ``run.device``.
        device: the device the run resolved to.
        parameters: the trained network's parameter count (None: unknown, treated as real-size).
        what: the model, for the message (e.g. ``sd3 stabilityai/stable-diffusion-3.5-medium``).

    Raises:
        DeviceError: ``requested`` is ``auto``, ``device`` is the CPU and the model is real-size.
    """
    if requested != "auto" or device.type != "cpu":
        return
    if parameters is not None and parameters < REAL_SIZE_PARAMETERS:
        return
    size = f"{parameters / 1e9:.1f}B parameters" if parameters is not None else "a model of unknown size"
    raise DeviceError(f"{what} ({size}) would train on the CPU: {no_cuda_reason()}; fix the GPU, or set "
                      "run.device=cpu to train on the CPU on purpose")


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


def resolve_device(text: str | None) -> torch.device:
    """A ``--device`` argument: None means cuda when available, else cpu; otherwise
    :func:`flowrl.hardware.usable_device` (``cpu``, ``cuda[:N]`` with that GPU present, ``mps`` where Metal is
    available, the tests' fake accelerator).

    Raises:
        ValueError: not a usable device here (a :class:`flowrl.hardware.DeviceError`; the message says the fix).
    """
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return usable_device(text, "--device")
