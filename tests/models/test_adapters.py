"""Behaviour shared by the SD3 and FLUX adapters: shapes, prompt cache, full fine-tuning's reference, checkpointing,
half precision (LoRA, reference and state, for every family: test_families.py)."""

from __future__ import annotations

import pytest
import torch

from flowrl.config import LoraConfig

from flowrl.models.base import unwrap

KINDS = ["sd3", "flux"]
PROMPTS = ["a red cat", "a blue square", "a red cat"]


def _text_encoders(model):
    return [m for name, m in model.frozen.items() if name.startswith("text_encoder")]


def _inputs(model, batch=3, sigma=0.7, prompts=PROMPTS):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, *model.latent_shape, generator=gen)
    return x, torch.tensor(sigma), model.encode_prompts(prompts[:batch])


@pytest.mark.parametrize("kind", KINDS)
def test_shapes_and_ranges(load, kind):
    model = load(kind)
    assert model.latent_shape == (16, 8, 8)
    x, sigma, cond = _inputs(model)
    assert set(cond) == {"prompt_embeds", "pooled_prompt_embeds"}
    seq = 16 + 16 if kind == "sd3" else 16  # SD3: CLIP tokens then T5 tokens; FLUX: T5 tokens
    assert cond["prompt_embeds"].shape == (3, seq, 32)
    assert cond["pooled_prompt_embeds"].shape == (3, 16)
    v = model.velocity(x, sigma, cond)
    assert v.dtype == torch.float32 and v.shape == x.shape and torch.isfinite(v).all()
    # sigma as a [B] tensor gives the same result
    torch.testing.assert_close(model.velocity(x, sigma.expand(3), cond), v)
    images = model.decode(x)
    assert images.shape == (3, 3, 64, 64) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1
    s = model.sigmas(6)
    assert s.shape == (7,) and s[0] == 1 and s[-1] == 0 and (s[1:] < s[:-1]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_cache_encodes_each_unique_prompt_once(load, kind):
    model = load(kind)
    calls = []
    for encoder in _text_encoders(model):
        encoder.register_forward_hook(lambda mod, args, kwargs_or_out, *rest: calls.append(mod))
    cond = model.encode_prompts(PROMPTS)
    # one batched call per text encoder for the 2 unique prompts
    assert len(calls) == len(_text_encoders(model))
    torch.testing.assert_close(cond["prompt_embeds"][0], cond["prompt_embeds"][2])
    assert not torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][1])
    calls.clear()
    again = model.encode_prompts(["a blue square", "a red cat"])
    assert calls == []
    torch.testing.assert_close(again["prompt_embeds"][1], cond["prompt_embeds"][0])
    # the cached rows equal the pipeline's own encode_prompt on a single prompt
    if kind == "sd3":
        ref, _, pooled, _ = model.pipeline.encode_prompt("a red cat", None, None, do_classifier_free_guidance=False,
                                                         max_sequence_length=model.max_sequence_length)
    else:
        ref, pooled, _ = model.pipeline.encode_prompt("a red cat", None, max_sequence_length=model.max_sequence_length)
    torch.testing.assert_close(cond["prompt_embeds"][:1], ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cond["pooled_prompt_embeds"][:1], pooled, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_parts_and_train_mode(load, kind):
    model = load(kind)
    assert all(not p.requires_grad for p in model.frozen.parameters())
    model.train()
    assert model.denoiser.training
    assert not any(m.training for m in model.frozen.modules())
    # full fine-tuning: every transformer weight is trainable
    assert len(model.trainable_parameters()) == len(list(model.denoiser.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_full_finetune_reference_is_a_frozen_copy(load, kind):
    model = load(kind)
    x, sigma, cond = _inputs(model)
    base = model.velocity(x, sigma, cond)
    model.freeze_reference()
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert (model.velocity(x, sigma, cond) - base).abs().max() > 1e-4
    with model.reference():
        torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)


@pytest.mark.parametrize("kind,lora", [("sd3", True), ("flux", True), ("sd3", False)])
def test_gradient_checkpointing_gives_the_same_gradients(load, kind, lora):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(3)
        model = load(kind, lora=LoraConfig(rank=4, alpha=8) if lora else None,
                     gradient_checkpointing=checkpointing)
        assert unwrap(model.denoiser).gradient_checkpointing is checkpointing
        module = unwrap(model.denoiser)
        if lora:  # non-zero lora_B so that lora_A gets gradients too
            with torch.no_grad():
                for name, p in module.named_parameters():
                    if "lora_B" in name:
                        p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        model.train()
        x, sigma, cond = _inputs(model, batch=2)
        loss = model.velocity(x, sigma, cond).pow(2).mean()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad})
    off, on = grads
    assert set(off) == set(on)
    # most parameters get a gradient (not all: e.g. SD3's last block discards its text-token outputs)
    assert sum(bool(g.abs().max() > 0) for g in off.values()) > 0.5 * len(off)
    for name in off:
        torch.testing.assert_close(on[name], off[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_half_precision_base_with_float32_lora(load, kind):
    model = load(kind, dtype="bf16", lora=LoraConfig(rank=4, alpha=8))
    module = unwrap(model.denoiser)
    base_dtypes = {p.dtype for n, p in module.named_parameters() if "lora_" not in n}
    assert base_dtypes == {torch.bfloat16}
    assert {p.dtype for p in model.trainable_parameters()} == {torch.float32}
    assert all(p.dtype == torch.bfloat16 for m in _text_encoders(model) for p in m.parameters())
    assert next(model.pipeline.vae.parameters()).dtype == torch.float32  # vae_dtype default
    x, sigma, cond = _inputs(model, batch=2)
    v = model.velocity(x, sigma, cond)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    v.pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.trainable_parameters())
    images = model.decode(x)
    assert images.dtype == torch.float32 and images.shape == (2, 3, 64, 64)
