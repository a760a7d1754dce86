"""Untrusted files and keys: EasyOCR weights from a user folder are never unpickled with code execution, and
API keys travel only over https or to loopback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import rewards
from rewards import RewardError

EVIL = """
import os, sys, torch

class Evil:
    def __reduce__(self):  # unpickling this calls open(marker, "w"): code chosen by whoever wrote the file
        return (open, (sys.argv[2], "w"))

torch.save({"weights": torch.zeros(2), "payload": Evil()}, sys.argv[1])
"""


@pytest.fixture(scope="module")
def evil_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("evil_ocr")
    marker = folder / "PWNED"
    for name in ("craft_mlt_25k.pth", "english_g2.pth"):
        subprocess.run([sys.executable, "-c", EVIL, str(folder / name), str(marker)], check=True)
    return folder, marker


def test_the_crafted_file_really_runs_code_when_fully_unpickled(evil_dir):
    """What EasyOCR's own loader (weights_only=False) would do with it: the payload creates the marker."""
    folder, marker = evil_dir
    subprocess.run([sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1], weights_only=False)",
                    str(folder / "english_g2.pth")], check=False, capture_output=True)
    assert marker.exists()
    marker.unlink()


def test_ocr_refuses_weights_that_are_not_plain_tensors(evil_dir):
    folder, marker = evil_dir
    with pytest.raises(RewardError, match="refusing .*craft_mlt_25k.pth.*weights_only=True"):
        rewards.load("ocr", model_dir=str(folder))
    assert not marker.exists()


@pytest.mark.slow
def test_ocr_reads_verified_copies_of_a_user_folder(tmp_path, ocr_reward):
    import easyocr_en_models
    from PIL import Image, ImageDraw, ImageFont
    import matplotlib

    for name in ("craft_mlt_25k.pth", "english_g2.pth"):
        os.symlink(os.path.join(easyocr_en_models.model_dir(), name), tmp_path / name)
    user = rewards.load("ocr", model_dir=str(tmp_path))
    font = ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf"), 28)
    image = Image.new("RGB", (200, 80), "white")
    ImageDraw.Draw(image).text((10, 20), "REWARD", fill="black", font=font)
    got = user([image], ['a sign that says "reward"'])
    assert got.scores.item() == 1.0
    assert torch.equal(got.scores, ocr_reward([image], ['a sign that says "reward"']).scores)
    assert not list(tmp_path.glob("flowrl-ocr-weights-*"))


def test_vlm_judge_sends_keys_only_over_https_or_loopback(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("OPENAI_API_KEY_HOSTS", "10.1.2.3,api.example.com")  # approved hosts (tests/test_security.py)
    with pytest.raises(RewardError, match="refusing to send api_key over plain http to http://10.1.2.3:8000"):
        rewards.load("vlm_judge", endpoint="http://10.1.2.3:8000", api_key="sk-explicit")
    with pytest.raises(RewardError, match=r"refusing to send \$OPENAI_API_KEY over plain http to http://10.1.2.3:8000"):
        rewards.load("vlm_judge", endpoint="http://10.1.2.3:8000")
    assert rewards.load("vlm_judge", endpoint="http://10.1.2.3:8000", api_key_env=None).headers == {}
    assert rewards.load("vlm_judge", endpoint="https://api.example.com").headers == {"Authorization": "Bearer sk-env"}
    assert rewards.load("vlm_judge", endpoint="http://127.0.0.1:8000").headers == {"Authorization": "Bearer sk-env"}
    assert rewards.load("vlm_judge", endpoint="http://localhost:8000").headers == {"Authorization": "Bearer sk-env"}
    opted = rewards.load("vlm_judge", endpoint="http://10.1.2.3:8000", api_key="k", insecure_key=True)
    assert opted.headers == {"Authorization": "Bearer k"}
