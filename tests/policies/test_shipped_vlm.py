"""The shipped Shapes-VQA model: safetensors, at most 25 MB, loads offline through the generic loader as a
real Qwen3-VL, and answers the held-out questions as its model card says (``experiments/vlm_card.py`` wrote it)."""

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
    from flowrl.envs.evaluate import ANSWER_MAX_NEW_TOKENS, evaluate_policy
    from flowrl.policies import TokenPolicy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    policy = TokenPolicy.from_pretrained(SHIPPED_VLM)
    assert policy.family.name == "qwen3_vl" and type(policy.model).__name__ == "Qwen3VLForConditionalGeneration"
    card = json.loads((SHIPPED_VLM / "model_card.json").read_text())
    metrics = evaluate_policy(policy, "shapes_vqa", 100, max_new_tokens=ANSWER_MAX_NEW_TOKENS)
    # Greedy decoding of a fixed held-out set: the first 100 questions give the card's number. A CPU that rounds
    # differently may flip a near-tie in a ~60-token trace, so up to 3 answers may differ (a different model, or a
    # trace cut short, moves it by far more).
    assert metrics["eval/vqa/accuracy"] == pytest.approx(card["eval_first_100"]["accuracy"], abs=0.03)
    assert 0.6 <= card["eval"]["accuracy"] <= 0.8 and card["eval"]["kinds"]["shape"] >= 0.8
    # How well its traces list the scenes (F1 of the listed objects, read from the final turns; measured 0.771 on
    # these 100): perception, the step every answer rests on, is what it lacks most.
    assert metrics["eval/vqa/scene_f1"] == pytest.approx(0.771, abs=0.03)
