"""The tiny Shapes-VQA vision-language model: a real ``Qwen2VLForConditionalGeneration`` built from a small
config, with a word-level tokenizer built locally with ``tokenizers`` and a real ``Qwen2VLProcessor``.

Because it is a stock transformers class saved with ``save_pretrained``, the same code that loads it
(:meth:`flowrl.policies.TokenPolicy.from_pretrained`) loads real Qwen2-VL / Qwen2.5-VL checkpoints.

Images are 32 x 32: patches of 4 px, merged 2 x 2, give 16 image tokens per image. The vocabulary is every
word of the Shapes-VQA questions and answers, the zoom tool's words, and Qwen's ChatML / vision / tool
tokens. The shipped weights (``flowrl/policies/shapes_vlm_checkpoint``) come from
``flowrl train configs/vlm/shapes_vqa_sft.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from flowrl.config import bounds

__all__ = ["ShapesVLMConfig", "mrope_sections", "build_tokenizer", "build_processor", "build_model", "SHIPPED_VLM", "VOCAB_WORDS",
           "resolve_model_path"]

SHIPPED_VLM = Path(__file__).parent / "shapes_vlm_checkpoint"

# Special tokens never appear in decoded text; the tool and answer tags are ordinary added tokens, so a
# decoded action still shows them to the tool-call parser.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>", "<unk>"]
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<answer>", "</answer>",
        "<think>", "</think>"]


def _vocab_words() -> list[str]:
    from flowrl.data.vqa import answer_vocabulary, question_words
    from flowrl.envs.zoom import QUADRANTS

    words = ["system", "user", "assistant", "tool", ":", "|", "(", ")", ",", "=", ";", ".", "?", "{", "}", '"']
    words += question_words() + answer_vocabulary() + ["zoom", "quadrant", *QUADRANTS]
    # Words of the error turns of malformed tool calls (flowrl/envs/tools.py).
    words += ("error empty the tool call is not valid json a needs name arguments must be mapping write as "
              "too many use unknown argument missing bad close with tools").split()
    return list(dict.fromkeys(words))


VOCAB_WORDS = _vocab_words()


@dataclass
class ShapesVLMConfig:
    """Architecture of the tiny VLM (Qwen2-VL classes)."""

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
    # the rotary half-dimension h.
    rope_theta: float = field(default=10000.0, metadata=bounds(gt=1))
    mrope_section: list[int] | None = None


def mrope_sections(config: ShapesVLMConfig) -> list[int]:
    """The (temporal, height, width) M-RoPE sections: ``config.mrope_section`` or the default split.

    Raises:
        ValueError: the sections do not add up to half the attention head dimension.
    """
    half = config.hidden_size // config.heads // 2  # the sections split the rotary half-dimension
    if config.mrope_section is None:
        return [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    sections = [int(x) for x in config.mrope_section]
    if len(sections) != 3 or min(sections) < 0 or sum(sections) != half:
        raise ValueError(f"model.mrope_section {sections} must be three numbers >= 0 (temporal, height, width) "
                         f"adding up to half the head dimension ({half} = hidden_size / heads / 2)")
    return sections


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
                                   extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})


def build_processor(config: ShapesVLMConfig | None = None):
    """A ``Qwen2VLProcessor`` whose image processor keeps 32 x 32 images at 32 x 32 (patch 4, merge 2)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    config = config or ShapesVLMConfig()
    pixels = config.image_size * config.image_size
    kw = dict(patch_size=config.patch_size, merge_size=2, temporal_patch_size=2)
    image_processor = Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels, **kw)
    video_processor = Qwen2VLVideoProcessor(**kw)
    return Qwen2VLProcessor(image_processor=image_processor, tokenizer=build_tokenizer(),
                            video_processor=video_processor)


def build_model(config: ShapesVLMConfig | None = None, seed: int = 0):
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` and its processor."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = config or ShapesVLMConfig()
    processor = build_processor(config)
    tok = processor.tokenizer
    sections = mrope_sections(config)
    hf_config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                         num_hidden_layers=config.layers, num_attention_heads=config.heads,
                         num_key_value_heads=config.kv_heads, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta),
                                          "mrope_section": sections},
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                         tie_word_embeddings=True),
        vision_config=dict(depth=config.vision_layers, embed_dim=config.vision_width, hidden_size=config.hidden_size,
                           num_heads=config.vision_heads, patch_size=config.patch_size, spatial_merge_size=2,
                           temporal_patch_size=2, mlp_ratio=2),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"), video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"), tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(hf_config)
    return model, processor


def resolve_model_path(path: str | None) -> str:
    """``None`` or ``"shapes_vlm"``: the shipped checkpoint; anything else as given."""
    if path in (None, "shapes_vlm"):
        if not (SHIPPED_VLM / "config.json").is_file():
            from flowrl.policies.policy import PolicyLoadError

            raise PolicyLoadError(f"the shipped Shapes-VQA model is missing at {SHIPPED_VLM}; reinstall flowrl or "
                                  "train one with `flowrl train configs/vlm/shapes_vqa_sft.yaml` and pass its model/ folder")
        return str(SHIPPED_VLM)
    return str(path)
