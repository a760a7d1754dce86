"""The fake-accelerator tier (``pytest -m device``, part of ``make test``): flowrl's device paths run on a CPU-backed
fake accelerator (flowrl/testing/fake_accelerator.py) that raises on mixed devices as CUDA does, so a user's GPU run
is never the first execution of a device path. Every test module here is marked ``device`` (``pytestmark``); ``make
test`` runs them in a pytest process of their own (after CPU backward passes in the same process, the fake device
trips an internal assert of torch)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def device():
    """The fake accelerator's ``torch.device`` (installed once per process, on first use)."""
    from flowrl.testing import fake_accelerator

    return fake_accelerator.install()


@pytest.fixture(scope="session")
def tiny_pickscore(tmp_path_factory) -> tuple[str, str]:
    """A tiny PickScore (a transformers CLIP) whose scores come back on the run's device."""
    from rewards.testing import tiny_hf_clip

    return tiny_hf_clip(tmp_path_factory.mktemp("pickscore"))
