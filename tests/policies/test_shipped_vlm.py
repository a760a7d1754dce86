"""The shipped Shapes-VQA model: safetensors, at most 25 MB, loads offline through the generic loader as a
real Qwen2-VL, and answers the held-out questions as its model card says."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.policies.shapes_vlm import SHIPPED_VLM


def test_shipped_model_files():
    files = {p.name: p.stat().st_size for p in SHIPPED_VLM.iterdir()}
    assert "model.safetensors" in files and not any(n.endswith((".bin", ".pt", ".pth")) for n in files)
    assert sum(files.values()) <= 25 * 2**20


def test_shipped_model_loads_offline_and_matches_its_card(monkeypatch):
    from flowrl.envs.evaluate import evaluate_policy
    from flowrl.policies import TokenPolicy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    policy = TokenPolicy.from_pretrained(SHIPPED_VLM)
    assert policy.family.name == "qwen2_vl" and type(policy.model).__name__ == "Qwen2VLForConditionalGeneration"
    card = json.loads((SHIPPED_VLM / "model_card.json").read_text())
    metrics = evaluate_policy(policy, "shapes_vqa", 100)
    # Greedy decoding of a fixed held-out set is deterministic: the first 100 questions give the card's number.
    assert metrics["eval/vqa/accuracy"] == pytest.approx(card["eval_first_100"]["accuracy"], abs=1e-9)
    assert 0.3 <= card["eval"]["accuracy"] <= 0.7
