"""The components of a tiny but real FLUX.2 [dev] pipeline (``Flux2Pipeline``), built offline.

FLUX.2 [dev] shares [klein]'s transformer class and VAE (:mod:`flowrl.testing.tiny_flux2`, same VAE seed and
batch-norm statistics) and differs in three places an adapter sees:

- the transformer has a guidance embedding (``guidance_embeds=True``: [dev] is guidance-distilled, no CFG);
- the text encoder is ``Mistral3ForConditionalGeneration`` (Mistral Small 3.1: a Mistral language model with a
  Pixtral vision tower), of which the pipeline stacks hidden states 10, 20 and 30, so the tiny one has 30 layers;
- the tokenizer is a ``PixtralProcessor`` (the pipeline calls its ``apply_chat_template`` on system + user
  messages whose content is a list of typed parts), built here from a ``PixtralImageProcessor`` and a local
  word-level tokenizer with a Mistral-style chat template (``[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]``).

The tiny vocabulary keeps the pipeline's system message as one token (the real tokenizer splits it into a few dozen),
so that the tiny models' 16-token sequences still hold the prompt after the pipeline's truncation.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["flux2_dev_components"]

_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
            "[IMG_BREAK]", "[IMG_END]"]

# A Mistral-style template over list-of-parts contents (what diffusers' format_input builds).
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}[IMG]{% endif %}{% endfor %}[/INST]"
    "{% endif %}{% endfor %}")


def _tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` with Mistral's special tokens and the pipeline's system message as
    one added token."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from flowrl.testing.tiny_qwen_image import _WORDS

    vocab = {w: i for i, w in enumerate(_SPECIAL + [",", ".", ":", "!", "?", "'", "-"] + sorted(set(_WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"[^\w\s]"), behavior="isolated"),
    ])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL])
    backend.add_tokens([AddedToken(SYSTEM_MESSAGE, special=False, normalized=False)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", model_max_length=2048)
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def _processor(tok):
    from transformers import PixtralImageProcessor, PixtralProcessor

    images = PixtralImageProcessor(patch_size=4, size={"longest_edge": 32})
    return PixtralProcessor(image_processor=images, tokenizer=tok, patch_size=4, spatial_merge_size=2,
                            chat_template=_CHAT_TEMPLATE)


def _text_encoder(tok, hidden: int, seed: int):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=30,
                num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=1024,
                sliding_window=None, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                  patch_size=4, image_size=32)
    config = Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=2,
                            image_token_index=tok.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Mistral3ForConditionalGeneration(config).eval()


def flux2_dev_components(workdir: str | Path) -> dict:
    """Keyword arguments of ``Flux2Pipeline(...)`` for a tiny random-weight FLUX.2 [dev]."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from flowrl.testing.tiny_flux2 import FLUX2_SCHEDULER, _vae

    del workdir
    with torch.random.fork_rng(devices=[]):
        tok = _tokenizer()
        torch.manual_seed(0)
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=16, mlp_ratio=2.0,
            axes_dims_rope=(2, 2, 2, 2), guidance_embeds=True).eval()
        return dict(transformer=transformer, vae=_vae(1), text_encoder=_text_encoder(tok, 16, seed=2),
                    tokenizer=_processor(tok), scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER))
