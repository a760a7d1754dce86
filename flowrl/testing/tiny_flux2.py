"""The components of a tiny but real FLUX.2 [klein] pipeline (``Flux2KleinPipeline``), built offline.

Real classes throughout: ``Flux2Transformer2DModel`` (double- and single-stream blocks, 4-axis RoPE),
``AutoencoderKLFlux2`` (32 latent channels, 2x2 patchified to 128, normalised by its batch-norm statistics, which
are set to non-trivial values here so that a wrong normalisation shows), ``Qwen3ForCausalLM`` as the text encoder
(28 layers, so the hidden states 9, 18 and 27 the pipeline stacks exist), a local word-level tokenizer with a
chat template, and ``FlowMatchEulerDiscreteScheduler``.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["flux2_klein_components", "FLUX2_SCHEDULER"]

#: FLUX.2's scheduler config (the pipeline passes its own empirical mu for the time shift).
FLUX2_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                       max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")


def _text_encoder(tok, hidden: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=28,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                         max_position_embeddings=1024, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def _vae(seed: int):
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4,
                             latent_channels=32, sample_size=64, use_quant_conv=True, use_post_quant_conv=True,
                             mid_block_add_attention=False, patch_size=(2, 2)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the real VAE's statistics are far from (0, 1)
        vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=generator))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=generator))
    return vae


def flux2_klein_components(workdir: str | Path, *, distilled: bool = False) -> dict:
    """Keyword arguments of ``Flux2KleinPipeline(...)`` for a tiny random-weight FLUX.2 [klein] (the base model,
    sampled with CFG; ``distilled=True``: the step-distilled one, no CFG)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from flowrl.testing.tiny_z_image import _tokenizer

    del workdir
    with torch.random.fork_rng(devices=[]):
        tok = _tokenizer()
        torch.manual_seed(0)
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=16, mlp_ratio=2.0,
            axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False).eval()
        return dict(transformer=transformer, vae=_vae(1), text_encoder=_text_encoder(tok, 16, seed=2),
                    tokenizer=tok, scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
                    is_distilled=distilled)
