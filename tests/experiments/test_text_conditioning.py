"""experiments/text_conditioning.py: the cosine at the differing token is 1 for a word the encoder ignores and lower
for one it reads; every pair differs in exactly one token position or more, and prompts that tokenize the same are
refused."""

from __future__ import annotations

import pytest

from experiments.text_conditioning import PAIRS, measure, token_cosines

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_the_cosines_of_the_shipped_model_separate_shapes_and_not_relations():
    from flowrl.models.config import ModelConfig, build_model

    model = build_model(ModelConfig(name="shapes"), "cpu").eval()
    assert token_cosines(model, "a red circle", "a red square")[0] < 0.9  # a shape word the encoder reads
    with pytest.raises(ValueError, match="tokenize the same"):
        token_cosines(model, "a red circle", "a red circle")
    result = measure(None)
    assert set(result) == set(PAIRS)
    assert all(-1 <= v <= 1 for v in result.values())
    # what the 2026-12-07 measurement found: relation directions are nearly invisible to the UNet
    assert result["relation, left vs right"] > 0.99 > result["shape"]
