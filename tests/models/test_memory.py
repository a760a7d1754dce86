"""Memory a GPU user would expect of the diffusers adapters, checked on the tiny SD3 / FLUX pipelines (nothing
downloaded): no reference copy for a full fine-tune whose run never calls the reference, float32 master weights for
a full fine-tune in bfloat16, VAE slicing that changes no image, text encoders kept on the CPU."""

from __future__ import annotations

import pytest
import torch

from flowrl.models.base import ReferenceUnavailableError, unwrap
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

PROMPTS = ["a red cat", "a blue square", "a red cat"]


def _inputs(model, batch=3, sigma=0.7):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, *model.latent_shape, generator=gen)
    return x, torch.tensor(sigma), model.encode_prompts(PROMPTS[:batch])


def _model_config(kind, path, **fields):
    from flowrl.models.config import ModelConfig

    return ModelConfig(name=kind, path=str(path), resolution=TINY_RESOLUTION,
                       max_sequence_length=TINY_MAX_SEQUENCE_LENGTH, **fields)


def _weight_storages(model) -> set[int]:
    """Every distinct weight storage the adapter holds on its device: denoiser, registered frozen parts and the
    reference copy (a plain attribute, outside the module tree)."""
    modules = [model]
    if model.__dict__.get("_reference") is not None:
        modules.append(model._reference)
    return {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}


# ---------------------------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_full_finetune_reference_copy_only_when_frozen(load, kind):
    model = load(kind)
    assert not model.has_reference and model.__dict__["_reference"] is None
    before = _weight_storages(model)
    x, sigma, cond = _inputs(model)
    with pytest.raises(ReferenceUnavailableError, match="keeps no reference copy"):
        with model.reference():
            pass
    assert _weight_storages(model) == before  # the failed call copied nothing
    base = model.velocity(x, sigma, cond)
    model.freeze_reference()
    assert model.has_reference
    denoiser_params = list(unwrap(model.denoiser).parameters())
    reference_params = list(model._reference.parameters())
    assert len(reference_params) == len(denoiser_params)
    assert not {id(p) for p in reference_params} & {id(p) for p in denoiser_params}
    assert len(_weight_storages(model)) == len(before) + len(denoiser_params)  # one more copy of the denoiser
    assert not any(p.requires_grad for p in reference_params)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert (model.velocity(x, sigma, cond) - base).abs().max() > 1e-4
    with model.reference():
        torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)


def test_lora_reference_needs_no_copy(load):
    from flowrl.config import LoraConfig

    model = load("sd3", lora=LoraConfig(rank=4, alpha=8))
    before = _weight_storages(model)
    assert model.has_reference
    model.freeze_reference()  # a no-op for LoRA: its reference is the adapters off
    assert model.__dict__["_reference"] is None and _weight_storages(model) == before
    x, sigma, cond = _inputs(model)
    with model.reference():
        model.velocity(x, sigma, cond)


# ------------------------------------------------------------------------------------------ master weights


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_full_finetune_in_bf16_keeps_float32_master_weights(load, kind):
    model = load(kind, dtype="bf16")
    module = unwrap(model.denoiser)
    x, sigma, cond = _inputs(model, batch=2)
    with torch.no_grad():
        v16 = model.velocity(x, sigma, cond)  # pure bfloat16 weights
    loaded = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert {p.dtype for p in loaded.values()} == {torch.bfloat16}
    model.freeze_reference()
    model.keep_float32_master_weights()
    assert {p.dtype for p in model.trainable_parameters()} == {torch.float32}
    assert model.dtype == torch.bfloat16  # what the model computes in
    for name, p in module.named_parameters():  # upcast exactly
        assert torch.equal(p.detach(), loaded[name].float()), name
    # the reference is the loaded bfloat16 weights, not a float32 copy
    assert {p.dtype for p in model._reference.parameters()} == {torch.bfloat16}
    for name, p in model._reference.named_parameters():
        assert torch.equal(p, loaded[name]), name
    with torch.no_grad():
        v32 = model.velocity(x, sigma, cond)  # float32 weights, bfloat16 compute under autocast
    # both compute in bf16 (autocast keeps a few ops in fp32): two bf16 ulps at |v| ~ 2
    torch.testing.assert_close(v32, v16, rtol=0, atol=0.03)
    model.train()
    model.velocity(x, sigma, cond).pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.trainable_parameters())
    # One AdamW step at lr 1e-5: about 1e-5 per weight, far below a bfloat16 weight's spacing (2^-8 relative), so
    # stepping bfloat16 weights would leave almost all of them unchanged; the float32 masters all move.
    params = model.trainable_parameters()
    moved_grads = [p.grad is not None and bool(p.grad.abs().max() > 0) for p in params]
    start = [p.detach().clone() for p in params]
    torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0).step()
    changed = sum(int((p.detach() != s).sum()) for p, s, g in zip(params, start, moved_grads) if g)
    total = sum(p.numel() for p, g in zip(params, moved_grads) if g)
    assert changed > 0.9 * total
    bf16 = [s.to(torch.bfloat16) for s in start]
    rounded = sum(int((p.detach().to(torch.bfloat16) != s).sum()) for p, s, g in zip(params, bf16, moved_grads) if g)
    assert rounded < 0.1 * total  # what a bfloat16 weight would have kept of the same step (3% here)


def test_master_weights_leave_lora_and_float32_models_alone(load):
    from flowrl.config import LoraConfig

    lora = load("sd3", dtype="bf16", lora=LoraConfig(rank=4, alpha=8))
    lora.keep_float32_master_weights()
    base = {p.dtype for n, p in unwrap(lora.denoiser).named_parameters() if "lora_" not in n}
    assert base == {torch.bfloat16} and lora._autocast_dtype is None
    full = load("sd3")
    full.keep_float32_master_weights()
    assert full._autocast_dtype is None and full.dtype == torch.float32


# ------------------------------------------------------------------------------------------------- the VAE


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_vae_slicing_gives_the_same_images(tiny_dir, kind):
    from flowrl.models.config import build_model

    sliced = build_model(_model_config(kind, tiny_dir(kind)), "cpu")  # vae_slicing on by default
    whole = build_model(_model_config(kind, tiny_dir(kind), vae_slicing=False), "cpu")
    assert sliced.pipeline.vae.use_slicing and not whole.pipeline.vae.use_slicing
    assert not sliced.pipeline.vae.use_tiling
    calls = []
    sliced.pipeline.vae.decoder.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    latents = torch.randn(3, *sliced.latent_shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        images = sliced.decode(latents)
        reference = whole.decode(latents)
    assert calls == [1, 1, 1]  # one image at a time
    assert images.shape == (3, 3, TINY_RESOLUTION, TINY_RESOLUTION)
    # a batch of 1 and of 3 take other convolution kernels: rounding only (a wrong slice would move pixels by 1e-2)
    torch.testing.assert_close(images, reference, rtol=0, atol=1e-5)


def test_vae_tiling_is_the_libraries_own(tiny_dir):
    from flowrl.models.config import build_model

    model = build_model(_model_config("sd3", tiny_dir("sd3"), vae_tiling=True), "cpu")
    assert model.pipeline.vae.use_tiling
    model.set_vae_memory(slicing=False, tiling=False)
    assert not model.pipeline.vae.use_tiling and not model.pipeline.vae.use_slicing


# ------------------------------------------------------------------------------------------- text encoders


def test_text_encoder_offload_on_the_cpu_encodes_the_same(tiny_dir):
    """On the CPU lending is a no-op; the encoders leave the module tree (so `.to(device)` cannot bring them back)
    and encode exactly as when resident. The device path is tests/device/test_model_memory.py."""
    from flowrl.models.config import build_model

    offloaded = build_model(_model_config("sd3", tiny_dir("sd3")), "cpu")  # offload_text_encoders on by default
    resident = build_model(_model_config("sd3", tiny_dir("sd3"), offload_text_encoders=False), "cpu")
    assert set(resident.text_encoders) == set(offloaded.text_encoders) == {"text_encoder", "text_encoder_2",
                                                                           "text_encoder_3"}
    assert not any(k.startswith("text_encoder") for k in offloaded.frozen)
    assert all(k in resident.frozen for k in resident.text_encoders)
    a, b = offloaded.encode_prompts(PROMPTS), resident.encode_prompts(PROMPTS)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    offloaded.set_text_encoder_offload(False)
    assert all(k in offloaded.frozen for k in offloaded.text_encoders)
