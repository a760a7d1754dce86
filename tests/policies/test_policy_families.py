"""The token-policy adapter on tiny random models of every supported family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Idefics3, SmolVLM, a text-only causal LM), loaded offline through the real loading code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.policies import PolicyLoadError, TokenPolicy, Turn
from flowrl.policies.testing import TINY_BUILDERS

FAMILIES = list(TINY_BUILDERS)
VISION = [f for f in FAMILIES if f != "causal_lm"]
TOKENS_PER_IMAGE = 4  # every tiny VLM: 16 px / patch 4 / merge 2, or 32 px / patch 8 / pixel shuffle 2


@pytest.fixture(scope="module", params=FAMILIES)
def policy(request, tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp(request.param)
    TINY_BUILDERS[request.param](folder)
    return TokenPolicy.from_pretrained(folder)


def _image(policy, seed: int) -> np.ndarray:
    size = 16 if policy.family.name.startswith("qwen") else 32
    return (np.random.default_rng(seed).random((size, size, 3)) * 255).astype(np.uint8)


def _images(policy, n: int, seed: int) -> list:
    return [_image(policy, seed + i) for i in range(n)] if policy.family.vision else []


def _multi_turn(policy) -> list[list[Turn]]:
    """Three conversations with 2, 1 and 0 images in the prompt; the first and last get an image back from
    the tool."""
    return [
        [Turn("user", "what colour is the {image} circle ? {image}" if policy.family.vision
              else "what colour is the circle ?", _images(policy, 2, 0))],
        [Turn("user", "how many", _images(policy, 1, 5))],
        [Turn("system", "yes"), Turn("user", "is there a square ?")],
    ]


def _play(policy, conversations, turns: int = 2):
    """Generate ``turns`` actions per conversation with tool turns between them; returns conversations and
    the rollout log-probs of each conversation's actions."""
    logps = [[] for _ in conversations]
    for turn in range(turns):
        gens = policy.generate(conversations, seeds=[10 * turn + i for i in range(len(conversations))],
                               max_new_tokens=4)
        nxt = []
        for i, (conv, gen) in enumerate(zip(conversations, gens)):
            conv = conv + [Turn("assistant", gen.text, token_ids=gen.token_ids)]
            logps[i].append(gen.logprobs)
            if turn < turns - 1:
                images = _images(policy, 1, 20 + i) if i != 1 else []
                conv = conv + [Turn("tool", "error : bad quadrant", images)]
            nxt.append(conv)
        conversations = nxt
    return conversations, [torch.cat(lp) for lp in logps]


def test_the_family_comes_from_the_config_model_type(policy):
    from flowrl.policies.families import FAMILIES as REGISTRY

    model_type = policy.base_model.config.model_type  # the tiny causal LM is a Qwen2ForCausalLM ("qwen2")
    assert policy.family.name == (model_type if model_type in REGISTRY else "causal_lm")
    assert policy.family.vision == (policy.family.name != "causal_lm")


def test_image_tokens_equal_image_features(policy):
    if not policy.family.vision:
        pytest.skip("text-only family")
    conversations, _ = _play(policy, _multi_turn(policy))
    inputs = policy.build_inputs(conversations)
    n_images = [3, 1, 1]  # prompt images + tool images per conversation
    assert inputs.num_image_tokens.tolist() == [n * TOKENS_PER_IMAGE for n in n_images]
    base = policy.base_model.model
    image_kwargs = {k: v for k, v in inputs.tensors.items() if k in policy.family.image_keys}
    with torch.no_grad():
        features = base.get_image_features(**image_kwargs).pooler_output
    rows = (sum(f.shape[0] for f in features) if isinstance(features, (tuple, list))
            else features.shape[0] * features.shape[1])
    assert rows == int(inputs.num_image_tokens.sum()) == sum(n_images) * TOKENS_PER_IMAGE
    with torch.no_grad():  # the model's own check of tokens against features passes
        policy.score(inputs)


def test_rescoring_returns_the_rollout_log_probs(policy):
    conversations, rollout = _play(policy, _multi_turn(policy))
    inputs = policy.build_inputs(conversations)
    with torch.no_grad():
        logp = policy.score(inputs)
    for i, expected in enumerate(rollout):
        got = logp[i][inputs.loss_mask[i] > 0]
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-5), (got, expected)


def test_loss_mask_is_exactly_the_generated_tokens(policy):
    conversations, _ = _play(policy, _multi_turn(policy))
    inputs = policy.build_inputs(conversations)
    for i, conv in enumerate(conversations):
        actions = [t.token_ids for t in conv if t.role == "assistant"]
        ids = inputs.input_ids[i][inputs.loss_mask[i] > 0].tolist()
        assert ids == [x for a in actions for x in a]
        turns = inputs.turn_index[i][inputs.loss_mask[i] > 0].tolist()
        assert turns == [k for k, a in enumerate(actions) for _ in a]
        assert (inputs.turn_index[i][inputs.loss_mask[i] == 0] == -1).all()


def test_rollout_and_training_inputs_share_the_prefix(policy):
    conversations, _ = _play(policy, _multi_turn(policy), turns=1)
    prompt = policy.build_inputs([c[:-1] for c in conversations], add_generation_prompt=True)
    full = policy.build_inputs(conversations)
    for i, conv in enumerate(conversations):
        p = prompt.input_ids[i][prompt.tensors["attention_mask"][i] > 0].tolist()
        f = full.input_ids[i][full.tensors["attention_mask"][i] > 0].tolist()
        assert f[: len(p)] == p
        assert f[len(p): len(p) + len(conv[-1].token_ids)] == conv[-1].token_ids


def test_sampling_is_per_sample_and_reproducible(policy):
    conversations = _multi_turn(policy)
    batch = policy.generate(conversations, seeds=[7, 8, 9], max_new_tokens=4)
    alone = policy.generate(conversations[1:2], seeds=[8], max_new_tokens=4)
    assert alone[0].token_ids == batch[1].token_ids
    again = policy.generate(conversations, seeds=[7, 8, 9], max_new_tokens=4)
    assert [g.token_ids for g in again] == [g.token_ids for g in batch]
    greedy = policy.generate(conversations, seeds=[0, 0, 0], max_new_tokens=4, greedy=True)
    assert [g.finish for g in greedy] == [("stop" if g.token_ids[-1:] and g.token_ids[-1] in policy.stop_token_ids
                                           else "length") for g in greedy]
    # Multimodal placeholders are never sampled (re-scoring would find no image features for them).
    for g in batch + again:
        assert not set(g.token_ids) & set(policy.banned_token_ids)


def test_lora_reference_is_the_base_model(policy, tmp_path):
    from flowrl.config import LoraConfig

    lora = TokenPolicy.prepare(policy.base_model, policy.processor, lora=LoraConfig(rank=4, alpha=8))
    try:
        targets = [n for n, p in lora.model.named_parameters() if p.requires_grad]
        assert targets and all("lora_" in n for n in targets)
        assert not any("visual" in n or "vision" in n for n in targets)  # only the language model is adapted
        conversations, _ = _play(lora, _multi_turn(lora), turns=1)
        inputs = lora.build_inputs(conversations)
        with torch.no_grad():
            before = lora.score(inputs)
            for n, p in lora.model.named_parameters():
                if "lora_B" in n:
                    p.add_(0.5)
            after = lora.score(inputs)
            with lora.reference():
                reference = lora.score(inputs)
        assert not torch.allclose(after, before)
        assert torch.allclose(reference, before, atol=1e-6)  # adapters off = the base model
    finally:
        lora.model.unload()  # leave the module-scoped base model without adapters


def test_full_fine_tuning_reference_is_a_frozen_copy(policy):
    import copy

    full = TokenPolicy.prepare(copy.deepcopy(policy.base_model), policy.processor)
    conversations, _ = _play(full, _multi_turn(full), turns=1)
    inputs = full.build_inputs(conversations)
    with torch.no_grad():
        before = full.score(inputs)
        for p in full.model.parameters():
            p.mul_(1.01)
        with full.reference():
            reference = full.score(inputs)
    assert torch.allclose(reference, before, atol=1e-6)
    assert not any(p.requires_grad for p in full._reference.parameters())


def test_gradient_checkpointing_gives_the_same_gradients(policy):
    import copy

    conversations, _ = _play(policy, _multi_turn(policy), turns=1)
    grads = []
    for checkpointing in (False, True):
        p = TokenPolicy.prepare(copy.deepcopy(policy.base_model), policy.processor,
                                gradient_checkpointing=checkpointing)
        p.train()
        inputs = p.build_inputs(conversations)
        p.score(inputs).sum().backward()
        grads.append(torch.cat([q.grad.flatten() for q in p.trainable_parameters() if q.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_text_only_family_refuses_images(tmp_path):
    folder = tmp_path / "lm"
    TINY_BUILDERS["causal_lm"](folder)
    lm = TokenPolicy.from_pretrained(folder)
    with pytest.raises(ValueError, match="takes no images"):
        lm.build_inputs([[Turn("user", "hi", [np.zeros((8, 8, 3), np.uint8)])]])


def test_missing_model_is_one_clear_error(tmp_path):
    with pytest.raises(PolicyLoadError, match="config.json"):
        TokenPolicy.from_pretrained(tmp_path / "nothing")


def test_stop_strings_and_max_tokens(policy):
    conversations = _multi_turn(policy)[2:]
    (free,) = policy.generate(conversations, seeds=[0], max_new_tokens=6, greedy=True)
    words = [policy.tokenizer.decode([t], skip_special_tokens=True) for t in free.token_ids]
    k = next((i for i, w in enumerate(words) if w.strip() and i >= 1), None)
    if free.finish != "length" or k is None:
        pytest.skip("the random model stopped at once")
    (cut,) = policy.generate(conversations, seeds=[0], max_new_tokens=6, greedy=True, stop_strings=(words[k].strip(),))
    # The action ends with the first token whose text completes the stop string; it is kept.
    first = next(i for i, w in enumerate(words) if words[k].strip() in w)
    assert cut.token_ids == free.token_ids[: first + 1] and cut.finish == "stop"
    assert cut.text.endswith(words[k].strip())
    assert len(free.token_ids) == 6 and torch.allclose(cut.logprobs, free.logprobs[: first + 1])


def test_score_can_return_the_entropy_of_the_tempered_distribution(policy):
    conversations, _ = _play(policy, _multi_turn(policy))
    inputs = policy.build_inputs(conversations)
    with torch.no_grad():
        logp, entropy = policy.score(inputs, temperature=0.7, with_entropy=True)
        assert torch.equal(logp, policy.score(inputs, temperature=0.7))
        # The entropy at one trained position, from the full logits by hand.
        out = policy.model(**inputs.to(policy.device).tensors, use_cache=False)
    mask = inputs.loss_mask > 0
    b, t = mask.nonzero()[0].tolist()
    logits = out.logits[b, t - 1].float() / 0.7
    if policy.banned_token_ids:
        logits[policy.banned_token_ids] = float("-inf")
    p = torch.softmax(logits, -1)
    expected = -(p[p > 0] * p[p > 0].log()).sum()
    assert abs(float(entropy[b, t]) - float(expected)) < 1e-4 * max(1.0, float(expected))
    assert (entropy[~mask] == 0).all() and (entropy[mask] > 0).all()


def test_shared_prompts_give_the_unshared_tokens_and_logprobs(policy):
    """``share_prompts``: a batch of 3 distinct questions x 4 copies (a GRPO epoch's groups, rows interleaved)
    samples the same tokens with the same log-probs as generating every row on its own; on the families with a
    shared-cache path the language model's prompt forward runs on 3 rows, not 12."""
    texts = ["what colour is the circle ?", "is there a square ?", "how many squares are there ?"]
    distinct = [[Turn("user", text, _images(policy, 1, 40 + i))] for i, text in enumerate(texts)]
    rows = [distinct[i % 3] for i in range(12)]
    seeds = list(range(100, 112))
    plain = policy.generate(rows, seeds=seeds, max_new_tokens=4)
    batch_rows = []
    language = policy.model.get_base_model() if policy.is_lora else policy.model
    lm = getattr(getattr(language, "model", language), "language_model", None) or getattr(language, "model", language)
    hook = lm.register_forward_pre_hook(
        lambda module, args, kwargs: batch_rows.append(
            (kwargs.get("inputs_embeds") if kwargs.get("inputs_embeds") is not None
             else kwargs["input_ids"]).shape[:2]),
        with_kwargs=True)
    try:
        shared = policy.generate(rows, seeds=seeds, max_new_tokens=4, share_prompts=True)
    finally:
        hook.remove()
    for a, b in zip(plain, shared):
        assert a.token_ids == b.token_ids and a.finish == b.finish
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4)  # float32 rounding of other shapes
    assert len({tuple(g.token_ids) for g in plain}) > 3  # rows of one question sample differently
    if policy.family.name in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "causal_lm"):
        prompt_len = batch_rows[0][1]
        assert batch_rows[0][0] == 3 and prompt_len > 4  # the prompt ran once per distinct question
        assert all(n == 12 and t == 1 for n, t in batch_rows[1:])  # then one token at a time for every row
