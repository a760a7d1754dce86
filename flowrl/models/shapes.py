"""The tiny text-to-image model of the shapes world, and its adapter.

A pixel-space diffusers ``UNet2DConditionModel`` (about 4M parameters) conditioned by cross-attention on
a tiny transformers ``CLIPTextModel``, whose word-level tokenizer is built with the ``tokenizers``
library from the shapes grammar and saved as ``tokenizer.json``. Trained with the flow-matching
objective (``flowrl/recipes/pretrain.py``); pixels are scaled to [-1, 1] and play the role of latents.

A saved model is a directory::

    model.json            ShapesModelConfig (architecture) + provenance
    unet/                 diffusers save_pretrained (config.json + safetensors)
    text_encoder/         transformers save_pretrained (config.json + safetensors)
    tokenizer/            tokenizer.json (+ tokenizer_config.json)

The shipped checkpoint lives in ``flowrl/models/shapes_checkpoint`` (loaded offline, no download).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from flowrl.config import bounds, from_dict, to_dict

from .base import Cond, FlowModel, ModelLoadError, unwrap
from flowrl.config import LoraConfig

__all__ = ["ShapesModelConfig", "ShapesModel", "TextConditionedUNet", "build_tokenizer", "SHIPPED_CHECKPOINT",
           "SHAPES_LORA_TARGETS"]

SHIPPED_CHECKPOINT = Path(__file__).parent / "shapes_checkpoint"
SPECIAL_TOKENS = ("[PAD]", "[BOS]", "[EOS]", "[UNK]")


#: LoRA targets of the shapes UNet: attention projections and the feed-forward layers of its transformer blocks.
SHAPES_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]


@dataclass
class ShapesModelConfig:
    """Architecture of the shapes model (saved in ``model.json``)."""

    resolution: int = field(default=32, metadata=bounds(ge=8))
    block_out_channels: list[int] = field(default_factory=lambda: [32, 64, 128])
    layers_per_block: int = field(default=1, metadata=bounds(ge=1))
    head_dim: int = field(default=32, metadata=bounds(ge=8))
    # Down blocks from the highest resolution: cross-attention everywhere but the first.
    cross_attention_from_block: int = field(default=1, metadata=bounds(ge=0))
    text_hidden_size: int = field(default=128, metadata=bounds(ge=8))
    text_layers: int = field(default=2, metadata=bounds(ge=1))
    text_heads: int = field(default=4, metadata=bounds(ge=1))
    max_prompt_tokens: int = field(default=16, metadata=bounds(ge=4))


def _grammar_words() -> list[str]:
    from flowrl.data.shapes import COLORS, NUMBER_WORDS, RELATIONS, SHAPES

    words = ["a", "and"] + list(COLORS) + list(SHAPES) + [s + "s" for s in SHAPES]
    words += list(NUMBER_WORDS.values()) + [w for r in RELATIONS for w in r.split()]
    return list(dict.fromkeys(words))


def build_tokenizer(max_length: int = 16):
    """A word-level tokenizer over the shapes grammar, as a transformers ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(list(SPECIAL_TOKENS) + _grammar_words())}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.Strip()])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", vocab["[BOS]"]), ("[EOS]", vocab["[EOS]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]", unk_token="[UNK]", model_max_length=max_length)


def _build_unet(config: ShapesModelConfig):
    from diffusers import UNet2DConditionModel

    n = len(config.block_out_channels)
    first = config.cross_attention_from_block
    down = tuple("DownBlock2D" if i < first else "CrossAttnDownBlock2D" for i in range(n))
    up = tuple("UpBlock2D" if i >= n - first else "CrossAttnUpBlock2D" for i in range(n))
    return UNet2DConditionModel(
        sample_size=config.resolution,
        in_channels=3,
        out_channels=3,
        block_out_channels=tuple(config.block_out_channels),
        layers_per_block=config.layers_per_block,
        down_block_types=down,
        up_block_types=up,
        mid_block_type="UNetMidBlock2DCrossAttn",
        cross_attention_dim=config.text_hidden_size,
        # diffusers reads `attention_head_dim` as the number of heads (a historical naming quirk).
        attention_head_dim=tuple(c // config.head_dim for c in config.block_out_channels),
        norm_num_groups=min(32, config.block_out_channels[0]),
    )


def _build_text_encoder(config: ShapesModelConfig, vocab_size: int):
    from transformers import CLIPTextConfig, CLIPTextModel

    text_config = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=config.text_hidden_size, intermediate_size=2 * config.text_hidden_size,
        num_hidden_layers=config.text_layers, num_attention_heads=config.text_heads,
        max_position_embeddings=config.max_prompt_tokens, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return CLIPTextModel(text_config)


class TextConditionedUNet(nn.Module):
    """The UNet with the text encoder inside it (``model.train_text_encoder``): the denoiser of a run that trains both.

    Everything that handles "the denoiser" (the optimizer's parameters, checkpoints, the EMA and snapshots, the frozen
    reference copy, DDP / FSDP wrapping, the on-policy teacher swap) then handles the text encoder with it, and the
    reference keeps the text encoder the run started from. Its forward encodes the prompt's token ids afresh, with
    gradients, instead of reading the cached embeddings.
    """

    def __init__(self, unet: nn.Module, text_encoder: nn.Module):
        super().__init__()
        self.unet = unet
        self.text_encoder = text_encoder

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, *, input_ids: torch.Tensor,
                encoder_attention_mask: torch.Tensor):
        """``x`` ``[B, 3, H, W]``, ``timestep`` ``[B]``, ``input_ids`` / ``encoder_attention_mask`` ``[B, L]``; returns
        the UNet's output (``.sample`` ``[B, 3, H, W]``)."""
        hidden = self.text_encoder(input_ids=input_ids, attention_mask=encoder_attention_mask).last_hidden_state
        return self.unet(x, timestep, encoder_hidden_states=hidden.to(x.dtype),
                         encoder_attention_mask=encoder_attention_mask)

    def enable_gradient_checkpointing(self) -> None:
        self.unet.enable_gradient_checkpointing()


class ShapesModel(FlowModel):
    """Adapter of the shapes model: pixel space in [-1, 1], velocity from the UNet at timestep 1000 sigma.

    Args:
        unet: the ``UNet2DConditionModel`` (the trained denoiser).
        text_encoder: the ``CLIPTextModel``; frozen here (the pretraining recipe trains it directly).
        tokenizer: the word-level tokenizer.
        config: the architecture.
        lora / gradient_checkpointing: see :class:`FlowModel`.
        default_guidance: classifier-free guidance scale used when a recipe sets none.
        train_text_encoder: the denoiser is a :class:`TextConditionedUNet` holding the UNet and this text encoder,
            both trained (full fine-tuning only); the conditioning then carries the prompt's ``input_ids``.
    """

    def __init__(self, unet: nn.Module, text_encoder: nn.Module, tokenizer, config: ShapesModelConfig, *,
                 lora: LoraConfig | None = None, gradient_checkpointing: bool = False,
                 default_guidance: float = 1.0, train_text_encoder: bool = False):
        self.config = config
        self.latent_shape = (3, config.resolution, config.resolution)
        if train_text_encoder and lora is not None:
            raise ValueError("train_text_encoder needs full fine-tuning: the LoRA targets the UNet only")
        self.trains_text_encoder = train_text_encoder
        denoiser = TextConditionedUNet(unet, text_encoder) if train_text_encoder else unet
        super().__init__(denoiser, lora=lora, gradient_checkpointing=gradient_checkpointing)
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.default_guidance = default_guidance
        self.text_encoder.requires_grad_(train_text_encoder).eval()

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(cls, config: ShapesModelConfig | None = None, *, seed: int = 0, **kwargs) -> "ShapesModel":
        """A randomly initialised model (for pretraining)."""
        config = config or ShapesModelConfig()
        tokenizer = build_tokenizer(config.max_prompt_tokens)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            unet = _build_unet(config)
            text_encoder = _build_text_encoder(config, len(tokenizer))
        return cls(unet, text_encoder, tokenizer, config, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, use_ema: bool = True, **kwargs) -> "ShapesModel":
        """Load a saved shapes model; ``None`` or ``"shapes"`` loads the shipped checkpoint.

        Raises:
            ModelLoadError: the directory or one of its parts is missing.
        """
        from diffusers import UNet2DConditionModel
        from transformers import CLIPTextModel, PreTrainedTokenizerFast

        path = SHIPPED_CHECKPOINT if path in (None, "shapes") else Path(path)
        needed = ["model.json", "unet/config.json", "text_encoder/config.json", "tokenizer/tokenizer.json"]
        missing = [n for n in needed if not (path / n).is_file()]
        if missing:
            hint = ("the shipped checkpoint is missing from the installed package; reinstall flowrl"
                    if path == SHIPPED_CHECKPOINT else
                    "point model.path at a directory written by `flowrl train configs/shapes/pretrain.yaml` "
                    "(its checkpoints/*/model) or leave it unset for the shipped model")
            raise ModelLoadError(f"shapes model at {str(path)!r} is missing {', '.join(missing)}; {hint}")
        try:
            meta = json.loads((path / "model.json").read_text())
            config = from_dict(ShapesModelConfig, meta["config"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:  # corrupt JSON, a foreign file
            raise ModelLoadError(f"shapes model at {str(path)!r}: model.json is not a flowrl model description "
                                 f"({type(err).__name__}: {' '.join(str(err).split())[:120]}); restore it or "
                                 "re-save the model") from None
        unet_dir = path / ("unet_ema" if use_ema and (path / "unet_ema").is_dir() else "unet")
        text_dir = path / ("text_encoder_ema" if use_ema and (path / "text_encoder_ema").is_dir() else "text_encoder")
        try:
            unet = UNet2DConditionModel.from_pretrained(unet_dir, torch_dtype=dtype, use_safetensors=True)
            text_encoder = CLIPTextModel.from_pretrained(text_dir, dtype=dtype, use_safetensors=True)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path / "tokenizer")
        except (OSError, ValueError, RuntimeError) as err:  # truncated or corrupt weights / configs
            raise ModelLoadError(f"shapes model at {str(path)!r} does not load ({type(err).__name__}: "
                                 f"{' '.join(str(err).split())[:160]}); restore its files or re-save the "
                                 "model") from None
        kwargs.setdefault("default_guidance", float(meta.get("default_guidance", 1.0)))
        model = cls(unet, text_encoder, tokenizer, config, **kwargs)
        return model.to(device)

    def save_pretrained(self, path: str | Path, *, extra: dict | None = None, ema: "ShapesModel | None" = None,
                        half: bool = False) -> None:
        """Write the model directory (see the module docstring). ``ema`` adds EMA weights beside the raw
        ones; ``half`` stores float16 weights (the shipped checkpoint, to stay small)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = {"config": to_dict(self.config), "default_guidance": self.default_guidance, **(extra or {})}
        (path / "model.json").write_text(json.dumps(meta, indent=2))
        dtype = torch.float16 if half else None

        def save(module: nn.Module, name: str) -> None:
            module = module if dtype is None else _half_copy(module)
            module.save_pretrained(path / name, safe_serialization=True)

        save(_unet(self.denoiser), "unet")
        save(self.text_encoder, "text_encoder")
        if ema is not None:
            save(_unet(ema.denoiser), "unet_ema")
            save(ema.text_encoder, "text_encoder_ema")
        self.tokenizer.save_pretrained(path / "tokenizer")

    # ------------------------------------------------------------------ FlowModel hooks

    def tokenize(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True,
                                max_length=self.config.max_prompt_tokens, return_tensors="pt")
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> Cond:
        """Text conditioning from tokens, with gradients (pretraining trains the text encoder)."""
        device = next(self.text_encoder.parameters()).device
        ids, mask = tokens["input_ids"].to(device), tokens["attention_mask"].to(device)
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        cond = {"encoder_hidden_states": hidden, "encoder_attention_mask": mask}
        if self.trains_text_encoder:  # the denoiser encodes the ids itself, with gradients
            cond["input_ids"] = ids
        return cond

    def _encode(self, prompts: list[str]) -> Cond:
        return self.encode_text(self.tokenize(prompts))

    def _predict(self, denoiser: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        dtype = next(denoiser.parameters()).dtype
        if self.trains_text_encoder:  # every denoiser it predicts with (live, reference, snapshot) holds the encoder
            return denoiser(x.to(dtype), sigma.to(dtype) * 1000.0, input_ids=cond["input_ids"],
                            encoder_attention_mask=cond["encoder_attention_mask"]).sample
        return denoiser(
            x.to(dtype), sigma.to(dtype) * 1000.0,
            encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
            encoder_attention_mask=cond["encoder_attention_mask"],
        ).sample

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] -> the model's data space (pixels in [-1, 1])."""
        return images * 2.0 - 1.0

    def default_lora_targets(self) -> list[str]:
        return list(SHAPES_LORA_TARGETS)


def _unet(denoiser: nn.Module) -> nn.Module:
    """The UNet of a denoiser (itself, or the one inside a :class:`TextConditionedUNet`)."""
    denoiser = unwrap(denoiser)
    return denoiser.unet if isinstance(denoiser, TextConditionedUNet) else denoiser


def _half_copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module).to(torch.float16)
