"""The tiny Shapes-VQA vision-language model: a real ``Qwen2VLForConditionalGeneration`` built from a small
config, with a word-level tokenizer built locally with ``tokenizers`` and a real ``Qwen2VLProcessor``; or, with
``family: qwen3_vl``, a ``Qwen3VLForConditionalGeneration`` with a ``Qwen3VLProcessor`` of the same sizes.

Because it is a stock transformers class saved with ``save_pretrained``, the same code that loads it
(:meth:`flowrl.policies.TokenPolicy.from_pretrained`) loads real Qwen2-VL / Qwen2.5-VL / Qwen3-VL
checkpoints.

The two families see positions differently. Qwen2-VL's vision tower has only relative (2D rotary)
positions, and its text model's M-RoPE gives the width axis the lowest frequencies. Qwen3-VL adds learned
absolute position embeddings to the vision tower's patches (a square table bilinearly resampled to the
image's patch grid; here the table is that grid, so nothing is resampled), interleaves the M-RoPE sections
so that temporal, height and width each get frequencies from the whole spectrum, and adds the features of
earlier vision layers to the first text layers (DeepStack).

Images are 32 x 32: patches of 4 px, merged 2 x 2, give 16 image tokens per image. The vocabulary is every
word of the Shapes-VQA questions and answers, the zoom tool's words, and Qwen's ChatML / vision / tool
tokens. The shipped weights (``flowrl/policies/shapes_vlm_checkpoint``) come from
``flowrl train configs/vlm/shapes_vqa_sft.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from flowrl.config import bounds

__all__ = ["ShapesVLMConfig", "mrope_sections", "deepstack_indexes", "build_tokenizer", "build_processor",
           "build_model", "SHIPPED_VLM", "VOCAB_WORDS", "resolve_model_path"]

SHIPPED_VLM = Path(__file__).parent / "shapes_vlm_checkpoint"

# Special tokens never appear in decoded text; the tool and answer tags are ordinary added tokens, so a
# decoded action still shows them to the tool-call parser.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>", "<unk>"]
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<answer>", "</answer>",
        "<think>", "</think>"]


def _vocab_words() -> list[str]:
    from flowrl.data.vqa import answer_vocabulary, question_words
    from flowrl.data.vqa_reasoning import reasoning_words
    from flowrl.envs.zoom import QUADRANTS

    words = ["system", "user", "assistant", "tool", ":", "|", "(", ")", ",", "=", ";", ".", "?", "{", "}", '"']
    words += question_words() + answer_vocabulary() + ["zoom", "quadrant", *QUADRANTS]
    words += reasoning_words()  # object tokens, cell digits and step marks of the reasoning traces
    # Words of the error turns of malformed tool calls (flowrl/envs/tools.py).
    words += ("error empty the tool call is not valid json a needs name arguments must be mapping write as "
              "too many use unknown argument missing bad close with tools").split()
    return list(dict.fromkeys(words))


VOCAB_WORDS = _vocab_words()


@dataclass
class ShapesVLMConfig:
    """Architecture of the tiny VLM (Qwen2-VL classes, or Qwen3-VL's with ``family: qwen3_vl``)."""

    # qwen2_vl: the shipped model's classes. qwen3_vl: the same sizes as a Qwen3-VL (absolute vision position
    # embeddings, interleaved M-RoPE, DeepStack from every vision layer but the last, a Qwen3 text model).
    family: Literal["qwen2_vl", "qwen3_vl"] = "qwen2_vl"
    hidden_size: int = field(default=128, metadata=bounds(ge=16))
    layers: int = field(default=4, metadata=bounds(ge=1))
    heads: int = field(default=4, metadata=bounds(ge=1))
    kv_heads: int = field(default=2, metadata=bounds(ge=1))
    intermediate_size: int = field(default=384, metadata=bounds(ge=16))
    vision_width: int = field(default=96, metadata=bounds(ge=16))
    vision_layers: int = field(default=3, metadata=bounds(ge=1))
    vision_heads: int = field(default=4, metadata=bounds(ge=1))
    patch_size: int = field(default=4, metadata=bounds(ge=1))
    image_size: int = field(default=32, metadata=bounds(ge=8))
    # Multimodal RoPE of the text model. Qwen2-VL splits the rotary half-dimension into (temporal, height,
    # width) sections in order of *decreasing* frequency, so the width axis gets the lowest frequencies:
    # at theta 10000 and sections [4, 6, 6] the width phase moves by at most ~0.01 rad across a 4 x 4 token
    # grid, and "left of" cannot be read from positions. A small theta (e.g. 10) gives every section
    # frequencies of 0.1-1 rad per position. None: the sections [h - 2 * (3h // 8), 3h // 8, 3h // 8] of
    # the rotary half-dimension h. Qwen3-VL interleaves the sections (height takes the frequencies 1, 4, 7, ...
    # and width 2, 5, 8, ... of the half-dimension, temporal the rest), so every axis spans the whole spectrum;
    # its default is Qwen3-VL's [24, 20, 20] of 64 scaled: [h - 2 * (5h // 16), 5h // 16, 5h // 16].
    rope_theta: float = field(default=10000.0, metadata=bounds(gt=1))
    mrope_section: list[int] | None = None


def mrope_sections(config: ShapesVLMConfig) -> list[int]:
    """The (temporal, height, width) M-RoPE sections: ``config.mrope_section`` or the family's default split.

    Raises:
        ValueError: the sections do not add up to half the attention head dimension, or (qwen3_vl) a height or
            width section reaches past the half-dimension in the interleaved layout.
    """
    half = config.hidden_size // config.heads // 2  # the sections split the rotary half-dimension
    if config.mrope_section is None:
        share = half * 5 // 16 if config.family == "qwen3_vl" else half * 3 // 8
        return [half - 2 * share, share, share]
    sections = [int(x) for x in config.mrope_section]
    if len(sections) != 3 or min(sections) < 0 or sum(sections) != half:
        raise ValueError(f"model.mrope_section {sections} must be three numbers >= 0 (temporal, height, width) "
                         f"adding up to half the head dimension ({half} = hidden_size / heads / 2)")
    # Interleaved, height owns indices 1, 4, ..., 3 h - 2 and width 2, 5, ..., 3 w - 1 of the half-dimension;
    # transformers silently drops indices past its end (and gives them to temporal), so refuse such sections.
    if config.family == "qwen3_vl" and (3 * sections[1] - 2 >= half or 3 * sections[2] - 1 >= half):
        raise ValueError(f"model.mrope_section {sections}: qwen3_vl interleaves the sections (height takes every "
                         f"third frequency from 1, width from 2), so height can be at most {(half + 1) // 3} and "
                         f"width at most {half // 3} of the {half} frequencies")
    return sections


def deepstack_indexes(config: ShapesVLMConfig) -> list[int]:
    """Qwen3-VL's DeepStack: the vision layers whose (merged) features are added to the image tokens' hidden
    states after text layers ``0, 1, ...``. Every vision layer but the last (whose features are the image
    tokens' input embeddings), a one-layer tower its only layer; at most one per text layer (transformers
    ignores the rest)."""
    return list(range(min(max(config.vision_layers - 1, 1), config.layers)))


def build_tokenizer():
    """The word-level tokenizer (``tokenizers`` WordLevel), as a transformers ``PreTrainedTokenizerFast``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + TAGS + ["\n"] + VOCAB_WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    # Words (underscores kept: top_left is one word), each punctuation mark alone; newlines are tokens.
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"[^\w\s]"), behavior="isolated"),
    ])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", model_max_length=1024,
                                   extra_special_tokens={"image_token": "<|image_pad|>",
                                                         "video_token": "<|video_pad|>"})


def build_processor(config: ShapesVLMConfig | None = None):
    """A ``Qwen2VLProcessor`` (or ``Qwen3VLProcessor``) whose image processor keeps 32 x 32 images at 32 x 32
    (patch 4, merge 2: 16 image tokens)."""
    from transformers import Qwen2VLImageProcessor

    config = config or ShapesVLMConfig()
    pixels = config.image_size * config.image_size
    kw = dict(patch_size=config.patch_size, merge_size=2, temporal_patch_size=2)
    if config.family == "qwen3_vl":
        from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor

        # Qwen3-VL's own preprocessing scales pixels to [-1, 1] (mean = std = 0.5), not by CLIP's statistics.
        image_processor = Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels, image_mean=[0.5] * 3,
                                                image_std=[0.5] * 3, **kw)
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=build_tokenizer(),
                                video_processor=Qwen3VLVideoProcessor(**kw))
    from transformers import Qwen2VLProcessor, Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels, **kw)
    video_processor = Qwen2VLVideoProcessor(**kw)
    return Qwen2VLProcessor(image_processor=image_processor, tokenizer=build_tokenizer(),
                            video_processor=video_processor)


def _text_config(config: ShapesVLMConfig, tok) -> dict:
    """The language model's config (a Qwen2 or Qwen3 text model), M-RoPE with ``config.rope_theta``."""
    rope = {"rope_type": "default", "rope_theta": float(config.rope_theta), "mrope_section": mrope_sections(config)}
    text = dict(vocab_size=len(tok), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=config.kv_heads,
                max_position_embeddings=1024, rope_parameters=rope, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=True)
    if config.family == "qwen3_vl":
        rope["mrope_interleaved"] = True  # what Qwen3-VL's configs say; transformers' Qwen3-VL always interleaves
        text["head_dim"] = config.hidden_size // config.heads  # Qwen3's head_dim is set, not derived (default 128)
    return text


def _vision_config(config: ShapesVLMConfig) -> dict:
    """The vision tower's config: patches of ``patch_size``, 2 x 2 merged into tokens of the text width."""
    common = dict(depth=config.vision_layers, num_heads=config.vision_heads, patch_size=config.patch_size,
                  spatial_merge_size=2, temporal_patch_size=2)
    if config.family == "qwen2_vl":
        return dict(common, embed_dim=config.vision_width, hidden_size=config.hidden_size, mlp_ratio=2)
    grid = config.image_size // config.patch_size  # patches per side: the learned position table is this grid
    return dict(common, hidden_size=config.vision_width, intermediate_size=2 * config.vision_width,
                out_hidden_size=config.hidden_size, num_position_embeddings=grid * grid,
                deepstack_visual_indexes=deepstack_indexes(config))


def build_model(config: ShapesVLMConfig | None = None, seed: int = 0):
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` (or ``Qwen3VLForConditionalGeneration``,
    ``config.family``) and its processor."""
    from transformers import (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen3VLConfig,
                              Qwen3VLForConditionalGeneration)

    config = config or ShapesVLMConfig()
    processor = build_processor(config)
    tok = processor.tokenizer
    Config, Model = ((Qwen3VLConfig, Qwen3VLForConditionalGeneration) if config.family == "qwen3_vl"
                     else (Qwen2VLConfig, Qwen2VLForConditionalGeneration))
    hf_config = Config(
        text_config=_text_config(config, tok), vision_config=_vision_config(config),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"), tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Model(hf_config)
    return model, processor


def resolve_model_path(path: str | None) -> str:
    """``None`` or ``"shapes_vlm"``: the shipped checkpoint; anything else as given."""
    if path in (None, "shapes_vlm"):
        if not (SHIPPED_VLM / "config.json").is_file():
            from flowrl.policies.policy import PolicyLoadError

            raise PolicyLoadError(f"the shipped Shapes-VQA model is missing at {SHIPPED_VLM}; reinstall flowrl or "
                                  "train one with `flowrl train configs/vlm/shapes_vqa_sft.yaml` and pass its model/ "
                                  "folder")
        return str(SHIPPED_VLM)
    return str(path)
