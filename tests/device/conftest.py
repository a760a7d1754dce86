"""The fake-accelerator tier (``pytest -m device``, part of ``make test``): flowrl's device paths run on a CPU-backed
fake accelerator (flowrl/testing/fake_accelerator.py) that raises on mixed devices as CUDA does, so a user's GPU run
is never the first execution of a device path. Every test in this folder is marked ``device``."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.device)


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
