"""Tiny reward models written to disk once per session (rewards.testing), loaded by the tests through
the same loaders as real checkpoints. Nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

from rewards import testing


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_rewards")


@pytest.fixture(scope="session")
def open_clip_dir(tiny_root) -> str:
    return testing.tiny_open_clip(tiny_root / "open_clip")


@pytest.fixture(scope="session")
def hps_files(tiny_root) -> tuple[str, str]:
    return testing.tiny_hps(tiny_root / "hps")


@pytest.fixture(scope="session")
def aesthetic_files(tiny_root) -> tuple[str, str]:
    return testing.tiny_aesthetic(tiny_root / "aesthetic")


@pytest.fixture(scope="session")
def hf_clip_dirs(tiny_root) -> tuple[str, str]:
    return testing.tiny_hf_clip(tiny_root / "hf_clip")


@pytest.fixture(scope="session")
def llava_dir(tiny_root) -> str:
    return testing.tiny_llava(tiny_root / "llava")


@pytest.fixture(scope="session")
def clip_reward(open_clip_dir):
    import rewards

    return rewards.load("clip_score", model_name=open_clip_dir, pretrained=None)


@pytest.fixture(scope="session")
def ocr_reward():
    import rewards

    return rewards.load("ocr")


@pytest.fixture
def images() -> torch.Tensor:
    return testing.random_images(3, 48, 64, seed=0)


@pytest.fixture
def prompts() -> list[str]:
    return ["a red cow", "the blue circle", "a red cow"]  # a repeated prompt, as in GRPO groups


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The test machine's 2 cores are shared; two OpenMP threads contending with other processes make
    EasyOCR and the tiny models 5-10x slower than one thread. Restored after each test."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
