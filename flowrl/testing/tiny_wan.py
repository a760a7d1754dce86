"""The components of a tiny but real Wan 2.1 / 2.2 text-to-video pipeline (``WanPipeline``), built offline.

Real classes throughout: ``WanTransformer3DModel`` (patch ``(1, 2, 2)``, self- and cross-attention blocks, 3D
RoPE), ``AutoencoderKLWan`` (the causal 3D VAE: spatial scale 8, temporal scale 4, per-channel ``latents_mean`` /
``latents_std`` normalisation with the real Wan 2.1 values), ``UMT5EncoderModel`` built from a config, a local T5
tokenizer (flowrl.testing.tiny_pipelines) and ``FlowMatchEulerDiscreteScheduler`` with a static flow shift.

``wan22=True`` adds Wan 2.2 A14B's second expert: ``transformer_2`` (the low-noise expert, different weights) and a
``boundary_ratio`` (the real A14B T2V's 0.875), so the pipeline switches experts at ``t = 875``.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["wan_components", "WAN_SCHEDULER", "WAN_VAE_MEAN", "WAN_VAE_STD", "TINY_WAN_NUM_FRAMES",
           "WAN22_BOUNDARY_RATIO"]

#: Pixel frames of the tiny video: ``(5 - 1) / 4 + 1 = 2`` latent frames (the VAE's temporal scale is 4).
TINY_WAN_NUM_FRAMES = 5

#: A static flow shift of 3 (Wan 2.1 T2V 1.3B's ``flow_shift`` at 480p, its model card's recommendation), in the
#: Euler scheduler flowrl samples with.
WAN_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)

#: Wan 2.2 A14B T2V's ``boundary_ratio`` (its ``model_index.json``).
WAN22_BOUNDARY_RATIO = 0.875

#: Per-channel latent statistics of the Wan 2.1 VAE (``vae/config.json`` of Wan-AI/Wan2.1-T2V-1.3B-Diffusers).
WAN_VAE_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN_VAE_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
               1.6382, 1.1253, 2.8251, 1.9160]


def _transformer(seed: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=16,
                                 out_channels=16, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()


def _vae(seed: int):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                            temperal_downsample=[False, True, True], dropout=0.0, latents_mean=WAN_VAE_MEAN,
                            latents_std=WAN_VAE_STD).eval()


def _text_encoder(vocab_size: int, d_model: int, seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=2,
                        relative_attention_num_buckets=8, relative_attention_max_distance=32,
                        feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                        decoder_start_token_id=0)
    torch.manual_seed(seed)
    return UMT5EncoderModel(config).eval()


def wan_components(workdir: str | Path, *, wan22: bool = False) -> dict:
    """Keyword arguments of ``WanPipeline(...)`` for a tiny random-weight Wan 2.1 (``wan22``: Wan 2.2 A14B's two
    experts)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from flowrl.testing.tiny_pipelines import _t5_tokenizer

    del workdir
    with torch.random.fork_rng(devices=[]):
        tok = _t5_tokenizer()
        components = dict(transformer=_transformer(0), vae=_vae(1), text_encoder=_text_encoder(len(tok), 32, seed=2),
                          tokenizer=tok, scheduler=FlowMatchEulerDiscreteScheduler(**WAN_SCHEDULER))
        if wan22:
            components.update(transformer_2=_transformer(3), boundary_ratio=WAN22_BOUNDARY_RATIO)
        return components


def wan22_components(workdir: str | Path) -> dict:
    """:func:`wan_components` with Wan 2.2's second expert."""
    return wan_components(workdir, wan22=True)
