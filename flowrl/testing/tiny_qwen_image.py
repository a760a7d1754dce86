"""The components of a tiny but real Qwen-Image pipeline (``QwenImagePipeline``), built offline.

Every component is the real class: ``QwenImageTransformer2DModel``, ``AutoencoderKLQwenImage`` (the Wan-style
causal 3D VAE Qwen-Image decodes with), ``Qwen2_5_VLForConditionalGeneration`` as the text encoder, a local
word-level tokenizer and ``FlowMatchEulerDiscreteScheduler``. The tiny models keep what an adapter depends on:
16 latent channels, a VAE scale factor of 8 (three downsampling levels), per-channel ``latents_mean`` /
``latents_std`` normalisation, 2x2 latent packing (``in_channels`` 64), the Qwen chat template whose first 34
tokens the pipeline drops (the tokenizer splits the system prompt into exactly 34 tokens, as the real one does),
and Qwen-Image's published scheduler config (dynamic exponential time shift with a terminal sigma).
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["qwen_image_components", "QWEN_IMAGE_VAE_MEAN", "QWEN_IMAGE_VAE_STD"]

#: Per-channel latent statistics of Qwen-Image's VAE (its ``vae/config.json``; the Wan 2.1 VAE's values).
QWEN_IMAGE_VAE_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                       -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
QWEN_IMAGE_VAE_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
                      1.6382, 1.1253, 2.8251, 1.9160]

#: Qwen-Image's ``scheduler/scheduler_config.json`` (the schedule fields).
QWEN_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                            max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                            time_shift_type="exponential")

_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
_WORDS = ("system user assistant describe the image by detailing color shape size texture quantity text spatial "
          "relationships of objects and background a an on in red green blue cat dog circle square triangle photo big "
          "small apple car mat bowl soup wooden table rain parked sleeping next to spoon turn make it").split()


def _tokenizer():
    """A word-level tokenizer (``PreTrainedTokenizerFast``) that splits on spaces and isolates punctuation and
    newlines, so the Qwen chat template's system part is 34 tokens, like Qwen2Tokenizer's."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(_SPECIAL + ["<unk>", "\n", ",", ".", ":", "!", "?", "'", "-"]
                                        + sorted(set(_WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"[^\w\s]"), behavior="isolated"),
    ])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", model_max_length=2048)


def _text_encoder(tok, hidden: int, seed: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    vision = dict(depth=1, hidden_size=16, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                  intermediate_size=16, out_hidden_size=hidden, fullatt_block_indexes=[0], window_size=16)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                              image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                              video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
                              vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
                              vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _vae(seed: int, resolution: int):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    # Three downsampling levels (scale factor 8, the real VAE's) on a narrow base width.
    return AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                                  temperal_downsample=[False, True, True], dropout=0.0,
                                  latents_mean=QWEN_IMAGE_VAE_MEAN, latents_std=QWEN_IMAGE_VAE_STD).eval()


def qwen_image_components(workdir: str | Path, resolution: int = 64) -> dict:
    """Keyword arguments of ``QwenImagePipeline(...)`` for a tiny random-weight Qwen-Image."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    del workdir  # the tokenizer is built in memory
    with torch.random.fork_rng(devices=[]):
        tok = _tokenizer()
        torch.manual_seed(0)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(2, 2, 4)).eval()
        return dict(transformer=transformer, vae=_vae(1, resolution), text_encoder=_text_encoder(tok, 32, seed=2),
                    tokenizer=tok, scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER))
