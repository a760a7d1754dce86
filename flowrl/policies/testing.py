"""Tiny random models of every supported family, saved with ``save_pretrained`` next to a real processor and a
word-level tokenizer built locally with ``tokenizers`` (nothing is downloaded). Tests load them through
:meth:`flowrl.policies.TokenPolicy.from_pretrained`, the code path of real checkpoints.

- :func:`tiny_qwen2_vl` / :func:`tiny_qwen2_5_vl`: ``Qwen2VLForConditionalGeneration`` /
  ``Qwen2_5_VLForConditionalGeneration`` with ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` (16 px images:
  patch 4, merge 2, 4 image tokens per image);
- :func:`tiny_qwen3_vl`: ``Qwen3VLForConditionalGeneration`` with ``Qwen3VLProcessor`` (the same 16 px images
  and 4 image tokens; a 2-layer vision tower with a 4 x 4 grid of learned position embeddings and DeepStack
  from its first layer; interleaved M-RoPE in a Qwen3 text model);
- :func:`tiny_idefics3` / :func:`tiny_smolvlm`: ``Idefics3ForConditionalGeneration`` /
  ``SmolVLMForConditionalGeneration`` with their processors (32 px images, patch 8, pixel shuffle 2: 4 image
  tokens per image, no image splitting);
- :func:`tiny_causal_lm`: ``Qwen2ForCausalLM`` with a ChatML tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["tiny_qwen2_vl", "tiny_qwen2_5_vl", "tiny_qwen3_vl", "tiny_idefics3", "tiny_smolvlm", "tiny_causal_lm",
           "TINY_BUILDERS", "word_tokenizer"]

_WORDS = ("system user assistant tool what colour is the circle square triangle red blue green yes no how many "
          "are there ? zoom ( ) top_left top_right bottom_left bottom_right error : , . 0 1 2 3 a an of").split()


def word_tokenizer(special: list[str], tags: list[str] = (), *, eos: str, pad: str, extra: dict | None = None):
    """A word-level ``PreTrainedTokenizerFast`` over a small vocabulary plus ``special`` tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(list(special) + list(tags) + ["<unk>", "\n"] + _WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"[^\w\s]"), behavior="isolated"),
    ])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if tags:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=pad, unk_token="<unk>",
                                   extra_special_tokens=extra or {})


_QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                 "<|video_pad|>"]
_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def _qwen_text(tok, **extra) -> dict:
    return dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None,
                **extra)


def _qwen(folder: str | Path, seed: int, v25: bool) -> str:
    if v25:
        from transformers import (Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model,
                                  Qwen2_5_VLProcessor as Processor)
    else:
        from transformers import (Qwen2VLConfig as Config, Qwen2VLForConditionalGeneration as Model,
                                  Qwen2VLProcessor as Processor)
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tok = word_tokenizer(_QWEN_SPECIAL, _TAGS, eos="<|im_end|>", pad="<|endoftext|>",
                         extra={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    kw = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
    processor = Processor(image_processor=Qwen2VLImageProcessor(min_pixels=256, max_pixels=256, **kw), tokenizer=tok,
                          video_processor=Qwen2VLVideoProcessor(**kw))
    vision = dict(depth=1, hidden_size=32, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    if v25:
        vision.update(intermediate_size=32, out_hidden_size=32, fullatt_block_indexes=[0], window_size=16)
    else:
        vision.update(embed_dim=16, mlp_ratio=2)
    config = Config(text_config=_qwen_text(tok), vision_config=vision,
                    image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                    video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
                    vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
                    vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    torch.manual_seed(seed)
    Model(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


def tiny_qwen2_vl(folder: str | Path, seed: int = 0) -> str:
    return _qwen(folder, seed, v25=False)


def tiny_qwen2_5_vl(folder: str | Path, seed: int = 0) -> str:
    return _qwen(folder, seed, v25=True)


def tiny_qwen3_vl(folder: str | Path, seed: int = 0) -> str:
    from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tok = word_tokenizer(_QWEN_SPECIAL, _TAGS, eos="<|im_end|>", pad="<|endoftext|>",
                         extra={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    kw = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=256, max_pixels=256, **kw),
                                 tokenizer=tok, video_processor=Qwen3VLVideoProcessor(**kw))
    # Head dim 16 (rotary half 8): the interleaved layout gives H the frequencies 1, 4, 7, ... and W 2, 5, ...
    # up to 3 * section, so [4, 2, 2] is Qwen3-VL's [24, 20, 20] scaled down with every index in range.
    text = _qwen_text(tok, head_dim=16)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                               "mrope_interleaved": True}
    # 16 px / patch 4 = a 4 x 4 patch grid, so 16 learned position embeddings are used as they are (no
    # interpolation); DeepStack adds the first vision layer's merged features to the first text layer.
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
    config = Qwen3VLConfig(text_config=text, vision_config=vision,
                           image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                           video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
                           vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
                           vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    torch.manual_seed(seed)
    Qwen3VLForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


def _idefics(folder: str | Path, seed: int, smol: bool) -> str:
    special = ["<|endoftext|>", "<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
    special += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok = word_tokenizer(special, _TAGS, eos="<end_of_utterance>", pad="<|endoftext|>")
    size = {"longest_edge": 32}
    if smol:
        from transformers import (SmolVLMConfig as Config, SmolVLMForConditionalGeneration as Model,
                                  SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor)

        processor = SmolVLMProcessor(image_processor=SmolVLMImageProcessor(size=size, max_image_size=size,
                                                                           do_image_splitting=False),
                                     tokenizer=tok, video_processor=SmolVLMVideoProcessor(), image_seq_len=4)
    else:
        from transformers import (Idefics3Config as Config, Idefics3ForConditionalGeneration as Model,
                                  Idefics3ImageProcessor, Idefics3Processor)

        processor = Idefics3Processor(image_processor=Idefics3ImageProcessor(size=size, max_image_size=size,
                                                                             do_image_splitting=False),
                                      tokenizer=tok, image_seq_len=4)
    config = Config(text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                                     max_position_embeddings=512),
                    vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=32, patch_size=8),
                    image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    Model(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


def tiny_idefics3(folder: str | Path, seed: int = 0) -> str:
    return _idefics(folder, seed, smol=False)


def tiny_smolvlm(folder: str | Path, seed: int = 0) -> str:
    return _idefics(folder, seed, smol=True)


def tiny_causal_lm(folder: str | Path, seed: int = 0) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = word_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], _TAGS, eos="<|im_end|>", pad="<|endoftext|>")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


TINY_BUILDERS = {"qwen2_vl": tiny_qwen2_vl, "qwen2_5_vl": tiny_qwen2_5_vl, "qwen3_vl": tiny_qwen3_vl,
                 "idefics3": tiny_idefics3, "smolvlm": tiny_smolvlm, "causal_lm": tiny_causal_lm}
