"""The model tests: ``load(kind)`` loads the tiny SD3 / FLUX pipeline that tests/conftest.py's ``tiny_dir`` builds
once per session (every family's tiny pipeline comes from there), through the real ``from_pretrained`` code; each
test is seeded and runs on one torch thread."""

from __future__ import annotations

import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION


@pytest.fixture(scope="session")
def load(tiny_dir):
    """``load(kind, **kwargs)``: a fresh adapter for the tiny ``"sd3"`` or ``"flux"`` pipeline."""

    def _load(kind: str, **kwargs):
        from flowrl.models.flux import FluxModel
        from flowrl.models.sd3 import SD3Model

        cls = {"sd3": SD3Model, "flux": FluxModel}[kind]
        kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
        kwargs.setdefault("resolution", TINY_RESOLUTION)
        return cls.from_pretrained(tiny_dir(kind), **kwargs)

    return _load


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one torch thread (tests/conftest.py's ``one_thread``)."""
