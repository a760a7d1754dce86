"""Tiny, randomly initialised reward models written to disk, for tests and benchmarks (no downloads).

Each builder writes files in the layout the real loaders expect and returns the arguments to pass to
``rewards.load``, so tests exercise the same loading code path as real checkpoints:

- :func:`tiny_open_clip` -> an open_clip ``local-dir:`` folder (``open_clip_config.json`` + weights);
- :func:`tiny_hps` -> an architecture folder plus an HPS-style ``{"state_dict": ...}`` checkpoint file;
- :func:`tiny_aesthetic` -> a CLIP folder plus an aesthetic-MLP state dict;
- :func:`tiny_hf_clip` -> a transformers ``CLIPModel`` folder and a ``CLIPProcessor`` folder with a
  locally built byte-level BPE tokenizer;
- :func:`tiny_llava` -> a ``LlavaForConditionalGeneration`` folder (tiny CLIP vision tower + tiny Llama)
  with a locally built word-level tokenizer that knows ``yes``/``no``, and a chat template.

And :class:`RedMinusBlue`, a toy differentiable reward for the reward-gradient and distillation recipes' tests,
registered by :func:`register_red_minus_blue`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rewards.base import Reward, RewardOutput

__all__ = ["tiny_open_clip", "tiny_hps", "tiny_aesthetic", "tiny_hf_clip", "tiny_llava", "TINY_OPEN_CLIP_CFG",
           "random_images", "RedMinusBlue", "register_red_minus_blue"]

TINY_OPEN_CLIP_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


class RedMinusBlue(Reward):
    """``mean red - mean blue`` of each image: smooth, differentiable, and moved by any colour shift (registered as
    ``toy_red_minus_blue`` by :func:`register_red_minus_blue`)."""

    name = "toy_red_minus_blue"
    differentiable = True

    def __init__(self, device: str = "cpu", **_):
        pass

    def score(self, images, prompts, metadata=None) -> RewardOutput:
        x = images.float()
        return RewardOutput(x[:, 0].mean(dim=(1, 2)) - x[:, 2].mean(dim=(1, 2)), {})


def register_red_minus_blue() -> str:
    """Register :class:`RedMinusBlue` (once per process); returns its name."""
    from rewards.registry import REWARDS

    if RedMinusBlue.name not in REWARDS.names():
        REWARDS.register(RedMinusBlue.name, RedMinusBlue)
    return RedMinusBlue.name


def random_images(n: int, height: int = 48, width: int = 64, seed: int = 0) -> torch.Tensor:
    """``[n, 3, height, width]`` smooth-ish random images in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, max(2, height // 8), max(2, width // 8), generator=g)
    fine = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    return (0.8 * fine + 0.2 * torch.rand(n, 3, height, width, generator=g)).clamp(0, 1)


def _write_open_clip_config(folder: Path, model_cfg: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    preprocess = {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711],
                  "interpolation": "bicubic", "resize_mode": "shortest"}
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess}))


def _random_open_clip_state(folder: Path, seed: int) -> dict[str, torch.Tensor]:
    import open_clip

    torch.manual_seed(seed)
    model = open_clip.create_model(f"local-dir:{folder}")  # config only: random initialisation
    # random init leaves logit_scale at log(1/0.07); keep it so scores have CLIP's usual scale
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def tiny_open_clip(folder: str | Path, seed: int = 0, model_cfg: dict | None = None) -> str:
    """A tiny open_clip model as a ``local-dir:`` folder with safetensors weights; returns the model name."""
    from safetensors.torch import save_file

    folder = Path(folder)
    _write_open_clip_config(folder, model_cfg or TINY_OPEN_CLIP_CFG)
    save_file(_random_open_clip_state(folder, seed), str(folder / "open_clip_model.safetensors"))
    return f"local-dir:{folder}"


def tiny_hps(folder: str | Path, seed: int = 1) -> tuple[str, str]:
    """An architecture-only ``local-dir:`` folder and an HPS-style checkpoint ``{"state_dict": ...}`` (torch
    file). Returns ``(model_name, checkpoint_path)``."""
    folder = Path(folder)
    arch = folder / "arch"
    _write_open_clip_config(arch, TINY_OPEN_CLIP_CFG)
    checkpoint = folder / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": _random_open_clip_state(arch, seed)}, checkpoint)
    return f"local-dir:{arch}", str(checkpoint)


def tiny_aesthetic(folder: str | Path, seed: int = 2) -> tuple[str, str]:
    """A tiny CLIP folder and an aesthetic-MLP state dict for its embedding width.
    Returns ``(model_name, mlp_path)``."""
    from .aesthetic import AestheticMLP

    folder = Path(folder)
    model_name = tiny_open_clip(folder / "clip", seed=seed)
    torch.manual_seed(seed)
    mlp = AestheticMLP(TINY_OPEN_CLIP_CFG["embed_dim"])
    path = folder / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(mlp.state_dict(), path)
    return model_name, str(path)


def _clip_tokenizer():
    """A byte-level BPE CLIP tokenizer built from a tiny vocabulary (all 256 byte symbols, with and
    without ``</w>``, a few merges, and the two special tokens)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    symbols = sorted(ByteLevel.alphabet())
    merges = [("a", "t</w>"), ("c", "o"), ("co", "w</w>"), ("r", "e"), ("re", "d</w>"), ("t", "h"), ("th", "e</w>")]
    vocab_list = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(vocab_list))}
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges)
    tokenizer.model_max_length = 32
    return tokenizer


def tiny_hf_clip(folder: str | Path, seed: int = 3, image_size: int = 32) -> tuple[str, str]:
    """A tiny transformers CLIPModel and CLIPProcessor saved with ``save_pretrained``.
    Returns ``(model_dir, processor_dir)``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    folder = Path(folder)
    tokenizer = _clip_tokenizer()
    vocab = tokenizer.get_vocab()
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=32, bos_token_id=vocab["<|startoftext|>"],
                         eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(folder / "model")
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder / "processor")
    return str(folder / "model"), str(folder / "processor")


_LLAVA_WORDS = ["<pad>", "<s>", "</s>", "<unk>", "<image>", "USER:", "ASSISTANT:", "yes", "no", "Yes", "No",
                "does", "this", "image", "show", "a", "an", "the", "of", "red", "blue", "cow", "circle", "square",
                "answer", "Answer", "or", "on", "scale", "from", "1", "to", "10", "how", "well", "match",
                "description", "with", "single", "number", "?", ".", ",", '"']
_LLAVA_TEMPLATE = ("{% for m in messages %}{{ m['role'].upper() }}: {% for c in m['content'] %}"
                   "{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}{% endfor %}"
                   "{% endfor %}{% if add_generation_prompt %}ASSISTANT: {% endif %}")


def tiny_llava(folder: str | Path, seed: int = 4) -> str:
    """A tiny LLaVA (CLIP vision tower 16x16, one-layer Llama) with processor and chat template; returns
    the folder. The word-level tokenizer splits on whitespace and punctuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

    folder = Path(folder)
    vocab = {w: i for i, w in enumerate(_LLAVA_WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Punctuation()])
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>",
                                        extra_special_tokens={"image_token": "<image>"})
    image_processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", chat_template=_LLAVA_TEMPLATE,
                               image_token="<image>", num_additional_image_tokens=1)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=16, patch_size=8),
        text_config=LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                pad_token_id=vocab["<pad>"], bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"]),
        image_token_index=vocab["<image>"], vision_feature_select_strategy="default", vision_feature_layer=-1,
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)
