"""The memory options of the diffusers adapters on the fake accelerator: text encoders kept on the CPU and lent to the
device only to encode uncached prompts (the embeddings are those of resident encoders), and a bfloat16 full fine-tune
computing under the device's autocast with float32 master weights."""

from __future__ import annotations

import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny

pytestmark = [pytest.mark.device, pytest.mark.usefixtures("one_thread")]

PROMPTS = ["a red apple", "a blue car", "a red apple"]


def _build(kind: str, device, **fields):
    from flowrl.models.config import ModelConfig, build_model

    cfg = ModelConfig(name=kind, path=str(build_tiny(kind)), resolution=TINY_RESOLUTION,
                      max_sequence_length=TINY_MAX_SEQUENCE_LENGTH, **fields)
    return build_model(cfg, device).to(device)


def _encode(model, prompts):
    """``model``'s Cond of ``prompts``, with a fixed source image per prompt for an editing model."""
    from flowrl.models.base import encode_rows

    gen = torch.Generator().manual_seed(0)
    source = torch.rand(3, TINY_RESOLUTION, TINY_RESOLUTION, generator=gen)
    return encode_rows(model, prompts, [{"source_image": source} for _ in prompts])


@pytest.mark.parametrize("kind", ["sd3", "flux", "z_image", "qwen_image", "flux2_klein", "wan", "flux_kontext",
                                  "qwen_image_edit"])
def test_offloaded_text_encoders_encode_on_the_device_and_go_back(kind, device):
    offloaded = _build(kind, device)  # model.offload_text_encoders: on by default
    resident = _build(kind, device, offload_text_encoders=False)
    encoders = offloaded.text_encoders
    assert encoders and all(p.device.type == "cpu" for m in encoders.values() for p in m.parameters())
    assert all(p.device == device for m in resident.text_encoders.values() for p in m.parameters())
    seen = []
    for module in encoders.values():
        module.register_forward_pre_hook(lambda m, args: seen.append({p.device for p in m.parameters()}))
    cond = _encode(offloaded, PROMPTS)
    assert seen and all(devices == {device} for devices in seen)  # each encoder ran on the device
    assert all(p.device.type == "cpu" for m in encoders.values() for p in m.parameters())  # and went back
    assert all(b.device.type == "cpu" for m in encoders.values() for b in m.buffers())
    expected = _encode(resident, PROMPTS)
    assert set(cond) == set(expected)
    for key in cond:
        assert cond[key].device == device
        torch.testing.assert_close(cond[key], expected[key], rtol=0, atol=0)
    seen.clear()
    _encode(offloaded, PROMPTS[:2])  # cached: the encoders are not lent again
    assert seen == []
    offloaded.to(device)  # moving the model leaves the offloaded encoders on the CPU
    assert all(p.device.type == "cpu" for m in encoders.values() for p in m.parameters())


def test_bf16_full_finetune_trains_float32_master_weights_on_the_device(device):
    model = _build("sd3", device, dtype="bfloat16")
    model.freeze_reference()
    model.keep_float32_master_weights()
    assert {p.dtype for p in model.trainable_parameters()} == {torch.float32}
    assert {p.device for p in model.trainable_parameters()} == {device}
    assert {p.dtype for p in model._reference.parameters()} == {torch.bfloat16}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, *model.latent_shape, generator=gen).to(device)
    cond = model.encode_prompts(PROMPTS[:2])
    model.train()
    v = model.velocity(x, torch.tensor(0.5, device=device), cond)
    assert v.dtype == torch.float32 and v.device == device
    v.pow(2).mean().backward()
    assert all(p.grad is None or (p.grad.dtype == torch.float32 and p.grad.device == device)
               for p in model.trainable_parameters())
    with torch.no_grad(), model.reference():
        ref = model.velocity(x, torch.tensor(0.5, device=device), cond)
    torch.testing.assert_close(ref, v.detach(), rtol=0, atol=0.03)  # the same bf16 weights, before any step
