"""experiments/vlm_trace_errors.py on the shipped Shapes-VQA model: the split by exact listings adds up to the
evaluation's own accuracy, and the command line writes its JSON."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import vlm_trace_errors  # noqa: E402


def test_trace_errors_split_the_evaluation(tmp_path, monkeypatch):
    from flowrl.envs.evaluate import ANSWER_MAX_NEW_TOKENS, evaluate_policy
    from flowrl.policies import TokenPolicy
    from flowrl.policies.shapes_vlm import SHIPPED_VLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    policy = TokenPolicy.from_pretrained(SHIPPED_VLM)
    result = vlm_trace_errors.trace_errors(policy, 40, batch_size=20)
    metrics = evaluate_policy(policy, "shapes_vqa", 40, max_new_tokens=ANSWER_MAX_NEW_TOKENS, batch_size=20)
    assert result["accuracy"] == pytest.approx(metrics["eval/vqa/accuracy"])
    every = result["kinds"].pop("all")
    assert sum(side[0] for side in every.values()) == 40
    assert every["listed_exactly"][0] == pytest.approx(40 * result["listed_exactly"])
    right = sum(count * acc for count, acc in every.values() if count)
    assert right == pytest.approx(40 * result["accuracy"])
    for kind, sides in result["kinds"].items():  # per kind, the same split
        assert sum(count * (acc or 0) for count, acc in sides.values()) == pytest.approx(
            metrics[f"eval/vqa/{kind}"] * sum(count for count, _ in sides.values()))
    # The shipped model lists most scenes exactly and is right more often when it does (0.79 vs 0.59 on 500).
    assert 0.3 < result["listed_exactly"] < 1 and 0.5 < result["consistency"] < 1
    assert every["listed_exactly"][1] > every["otherwise"][1]

    out = tmp_path / "errors.json"
    assert vlm_trace_errors.main(["--n", "20", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["n"] == 20
