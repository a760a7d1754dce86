"""Tiny SD3 / FLUX pipelines built once per session and written to disk, so every test loads them
through the real ``from_pretrained`` code."""

from __future__ import annotations

import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny_flux, build_tiny_sd3


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_pipelines")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see _one_thread
    try:
        return {"sd3": build_tiny_sd3(root / "sd3"), "flux": build_tiny_flux(root / "flux")}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def load(tiny_dirs):
    """``load(kind, **kwargs)``: a fresh adapter for the tiny ``"sd3"`` or ``"flux"`` pipeline."""

    def _load(kind: str, **kwargs):
        from flowrl.models.flux import FluxModel
        from flowrl.models.sd3 import SD3Model

        cls = {"sd3": SD3Model, "flux": FluxModel}[kind]
        kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
        kwargs.setdefault("resolution", TINY_RESOLUTION)
        return cls.from_pretrained(tiny_dirs[kind], **kwargs)

    return _load


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one torch thread (tests/conftest.py's ``one_thread``)."""
