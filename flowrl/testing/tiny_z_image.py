"""The components of a tiny but real Z-Image pipeline (``ZImagePipeline``), built offline.

Real classes throughout: ``ZImageTransformer2DModel`` (single-stream DiT with noise and caption refiners),
``AutoencoderKL`` (the 16-channel FLUX VAE with its scaling and shift factors), ``Qwen3Model`` as the text encoder
(Z-Image reads its second-to-last hidden state), a local word-level tokenizer with Qwen3's chat template, and
``FlowMatchEulerDiscreteScheduler`` with Z-Image's static shift 3.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["z_image_components", "Z_IMAGE_SCHEDULER"]

#: Z-Image(-Turbo)'s ``scheduler/scheduler_config.json``: a static time shift of 3.
Z_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)

# Qwen3's chat template for one user turn with a generation prompt (what ZImagePipeline asks for with
# enable_thinking=True: no empty think block).
_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer():
    from flowrl.testing.tiny_qwen_image import _tokenizer as qwen_tokenizer

    tok = qwen_tokenizer()
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def _text_encoder(tok, hidden: int, seed: int):
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                         max_position_embeddings=1024, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    return Qwen3Model(config).eval()


def z_image_components(workdir: str | Path) -> dict:
    """Keyword arguments of ``ZImagePipeline(...)`` for a tiny random-weight Z-Image."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    from flowrl.testing.tiny_pipelines import _FLUX_VAE_FACTORS, _vae

    del workdir
    with torch.random.fork_rng(devices=[]):
        tok = _tokenizer()
        torch.manual_seed(0)
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[256, 32, 32]).eval()
        return dict(transformer=transformer, vae=_vae(_FLUX_VAE_FACTORS, seed=1),
                    text_encoder=_text_encoder(tok, 32, seed=2), tokenizer=tok,
                    scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER))
