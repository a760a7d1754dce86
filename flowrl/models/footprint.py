"""What a model costs before any weight is downloaded: parameter counts of the real architecture (built on the
``meta`` device from its configs), the LoRA's trainable parameters, and a rough memory estimate of a training
process. ``flowrl train CONFIG --dry-run`` prints it (docs/distributed.md, "Dry runs").

The architecture comes from, in order: ``model.path`` when it is a local pipeline directory, the Hugging Face
cache (the configs only), or the published configs of the models flowrl's recipes name (:data:`KNOWN_MODELS`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from flowrl.models.config import ModelConfig
    from rewards.config import RewardConfig

__all__ = ["KNOWN_MODELS", "TWO_EXPERTS", "SD35_MEDIUM_TRANSFORMER", "SD3_VAE", "Footprint", "footprint",
           "memory_estimate", "reward_memory", "REWARD_PARAMS", "text_encoder_params", "weights_status", "format_gib"]

SD35_MEDIUM_TRANSFORMER = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
                "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
                "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "pos_embed_max_size": 384,
                "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm"}
_SD35_LARGE = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 38,
               "attention_head_dim": 64, "num_attention_heads": 38, "joint_attention_dim": 4096,
               "caption_projection_dim": 2432, "pooled_projection_dim": 2048, "pos_embed_max_size": 192,
               "qk_norm": "rms_norm"}
_SD3_MEDIUM = {**SD35_MEDIUM_TRANSFORMER, "pos_embed_max_size": 192, "dual_attention_layers": [], "qk_norm": None}
_FLUX_DEV = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
             "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
             "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]}

# Qwen/Qwen-Image's transformer/config.json (about 20B parameters).
_QWEN_IMAGE = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
               "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
               "axes_dims_rope": [16, 56, 56]}

# Tongyi-MAI/Z-Image-Turbo's transformer/config.json (about 6B parameters); Z-Image's base model shares it.
_Z_IMAGE = {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840, "n_layers": 30,
            "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "cap_feat_dim": 2560, "axes_dims": [32, 48, 48],
            "axes_lens": [1536, 512, 512]}

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers' transformer/config.json (about 1.4B parameters) and the 14B one, which
# Wan-AI/Wan2.2-T2V-A14B-Diffusers' transformer/ and transformer_2/ share (two experts of about 14B each).
_WAN_1_3B = {"patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
             "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
             "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}
_WAN_14B = {**_WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
# black-forest-labs/FLUX.2-dev's transformer/config.json (about 32B parameters: 8 double-stream and 48 single-stream
# blocks of 48 heads x 128, Mistral's 3 x 5120 text features in; diffusers' Flux2Transformer2DModel defaults).
_FLUX2_DEV = {"patch_size": 1, "in_channels": 128, "num_layers": 8, "num_single_layers": 48, "attention_head_dim": 128,
              "num_attention_heads": 48, "joint_attention_dim": 15360, "timestep_guidance_channels": 256,
              "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32], "guidance_embeds": True}
# black-forest-labs/FLUX.2-klein-4B's and -9B's transformer/config.json (the base and the distilled checkpoints share
# them): the [dev] blocks at 24 / 32 heads x 128, 5 + 20 / 8 + 24 blocks, three Qwen3 hidden states (3 x 2560 /
# 3 x 4096) in, no guidance embedding (the base samples with CFG, the distilled without).
_FLUX2_KLEIN_4B = {**_FLUX2_DEV, "num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24,
                   "joint_attention_dim": 7680, "guidance_embeds": False, "rope_theta": 2000}
_FLUX2_KLEIN_9B = {**_FLUX2_KLEIN_4B, "num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32,
                   "joint_attention_dim": 12288}

#: Published transformer configs of the models flowrl's configs name (diffusers ``config.json`` fields).
KNOWN_MODELS: dict[str, tuple[str, dict]] = {
    "stabilityai/stable-diffusion-3.5-medium": ("sd3", SD35_MEDIUM_TRANSFORMER),
    "stabilityai/stable-diffusion-3.5-large": ("sd3", _SD35_LARGE),
    "stabilityai/stable-diffusion-3-medium-diffusers": ("sd3", _SD3_MEDIUM),
    "black-forest-labs/FLUX.1-dev": ("flux", _FLUX_DEV),
    "black-forest-labs/FLUX.1-schnell": ("flux", {**_FLUX_DEV, "guidance_embeds": False}),
    "Qwen/Qwen-Image": ("qwen_image", _QWEN_IMAGE),
    # Qwen-Image-Edit's transformer/config.json is Qwen-Image's (the same 20B transformer, fine-tuned for editing);
    # FLUX.1-Kontext-dev's is FLUX.1-dev's.
    "Qwen/Qwen-Image-Edit": ("qwen_image_edit", _QWEN_IMAGE),
    "black-forest-labs/FLUX.1-Kontext-dev": ("flux_kontext", _FLUX_DEV),
    "Tongyi-MAI/Z-Image-Turbo": ("z_image", _Z_IMAGE),
    "Tongyi-MAI/Z-Image": ("z_image", _Z_IMAGE),
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": ("wan", _WAN_1_3B),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": ("wan", _WAN_14B),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": ("wan", _WAN_14B),
    "black-forest-labs/FLUX.2-dev": ("flux2", _FLUX2_DEV),
    "black-forest-labs/FLUX.2-klein-4B": ("flux2_klein", _FLUX2_KLEIN_4B),
    "black-forest-labs/FLUX.2-klein-base-4B": ("flux2_klein", _FLUX2_KLEIN_4B),
    "black-forest-labs/FLUX.2-klein-9B": ("flux2_klein", _FLUX2_KLEIN_9B),
    "black-forest-labs/FLUX.2-klein-base-9B": ("flux2_klein", _FLUX2_KLEIN_9B),
}

#: Models with a second expert of the same architecture (Wan 2.2 A14B's ``transformer_2``).
TWO_EXPERTS = {"Wan-AI/Wan2.2-T2V-A14B-Diffusers"}

# Wan's text encoder (UMT5-XXL's encoder, text_encoder/config.json) and its causal 3D VAE (vae/config.json).
_UMT5_XXL = {"d_model": 4096, "d_ff": 10240, "num_layers": 24, "num_heads": 64, "d_kv": 64, "vocab_size": 256384,
             "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32}
_WAN_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
            "temperal_downsample": [False, True, True]}

# Z-Image's and FLUX.2-klein-4B's text encoder (Qwen3-4B, text_encoder/config.json; input and output embeddings
# tied) and FLUX.2-klein-9B's (Qwen3-8B, untied).
_QWEN3_4B = {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}
_QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}

# Qwen-Image's text encoder (Qwen2.5-VL-7B-Instruct, text_encoder/config.json) and VAE (vae/config.json).
_QWEN25_VL_7B = {"text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                                 "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                                     "mrope_section": [16, 24, 24]}},
                 "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                   "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                                   "temporal_patch_size": 2, "window_size": 112,
                                   "fullatt_block_indexes": [7, 15, 23, 31]}}
_QWEN_IMAGE_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
                   "temperal_downsample": [False, True, True]}

# The text encoders and VAE every SD3 / FLUX.1 checkpoint ships (CLIP ViT-L/14, OpenCLIP bigG/14, T5 v1.1 XXL
# encoder, the 16-channel VAE).
_CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
           "projection_dim": 768, "vocab_size": 49408, "max_position_embeddings": 77}
_CLIP_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
           "projection_dim": 1280, "vocab_size": 49408, "max_position_embeddings": 77}
_T5_XXL = {"d_model": 4096, "d_ff": 10240, "num_layers": 24, "num_heads": 64, "d_kv": 64, "vocab_size": 32128,
           "feed_forward_proj": "gated-gelu"}
SD3_VAE = {"in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [128, 256, 512, 512],
        "layers_per_block": 2, "latent_channels": 16, "use_quant_conv": False, "use_post_quant_conv": False}

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Footprint:
    """Parameter counts of a model's parts and the shapes that size its activations.

    Attributes:
        source: where the architecture came from (a directory, the HF cache, or "published config").
        params: ``{component: parameters}`` (transformer / unet, text encoders, vae).
        trainable: parameters the run trains (LoRA or the whole denoiser).
        hidden / layers / tokens: the denoiser's width, blocks and tokens per image at the run's resolution
            (image patches + text tokens); None for the shapes UNet.
    """

    source: str
    params: dict[str, int]
    trainable: int
    hidden: int | None = None
    layers: int | None = None
    tokens: int | None = None
    notes: list[str] = field(default_factory=list)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _lora_params(denoiser: nn.Module, targets: list[str], rank: int) -> int:
    """``r (in + out)`` for every Linear whose name ends with a target (peft's suffix matching)."""
    total = 0
    for name, module in denoiser.named_modules():
        if isinstance(module, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            total += rank * (module.in_features + module.out_features)
    return total


def _read_config(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _configs(cfg) -> tuple[str, dict | None, dict[str, dict], str]:
    """``(kind, transformer config, {component: config}, source)`` of an sd3 / flux model section."""
    path = Path(str(cfg.path)).expanduser()
    names = ("transformer", "transformer_2", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")
    if path.is_dir():
        found = {n: _read_config(path / n / "config.json") for n in names}
        return cfg.name, found.pop("transformer"), {k: v for k, v in found.items() if v}, str(path)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = {}
        for n in names:
            hit = try_to_load_from_cache(str(cfg.path), f"{n}/config.json")
            found[n] = _read_config(Path(hit)) if isinstance(hit, str) else None
        if found["transformer"]:
            return cfg.name, found.pop("transformer"), {k: v for k, v in found.items() if v}, "Hugging Face cache"
    except Exception:  # noqa: BLE001 - no hub library state: fall back to the published configs
        pass
    if str(cfg.path) in KNOWN_MODELS:
        kind, transformer = KNOWN_MODELS[str(cfg.path)]
        found = {"transformer_2": dict(transformer)} if str(cfg.path) in TWO_EXPERTS else {}
        return kind, dict(transformer), found, "published config"
    return cfg.name, None, {}, ""


def _text_and_vae(kind: str, found: dict[str, dict], transformer_cfg: dict) -> dict[str, nn.Module]:
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    def clip(config, projection):
        cls = CLIPTextModelWithProjection if projection else CLIPTextModel
        return cls(CLIPTextConfig(**{k: v for k, v in config.items() if not k.startswith("_")}))

    def t5(config):
        return T5EncoderModel(T5Config(**{k: v for k, v in config.items() if not k.startswith("_")}))

    if kind == "wan":
        from diffusers import AutoencoderKLWan
        from transformers import UMT5Config, UMT5EncoderModel

        vae = {k: v for k, v in (found.get("vae") or _WAN_VAE).items() if not k.startswith("_")}
        text = {k: v for k, v in (found.get("text_encoder") or _UMT5_XXL).items() if not k.startswith("_")}
        return {"vae": AutoencoderKLWan.from_config(vae),
                "text_encoder (UMT5-XXL)": UMT5EncoderModel(UMT5Config(**text))}
    if kind in ("qwen_image", "qwen_image_edit"):
        from diffusers import AutoencoderKLQwenImage
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        vae = {k: v for k, v in (found.get("vae") or _QWEN_IMAGE_VAE).items() if not k.startswith("_")}
        text = {k: v for k, v in (found.get("text_encoder") or _QWEN25_VL_7B).items() if not k.startswith("_")}
        return {"vae": AutoencoderKLQwenImage.from_config(vae),
                "text_encoder (Qwen2.5-VL)": Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**text))}
    if kind == "flux2":  # Mistral Small 3.1 (Mistral3Config's defaults are its config) and FLUX.2's 32-channel VAE
        from diffusers import AutoencoderKLFlux2
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        vae = {k: v for k, v in (found.get("vae") or {}).items() if not k.startswith("_")}
        text = {k: v for k, v in (found.get("text_encoder") or {}).items() if not k.startswith("_")}
        return {"vae": AutoencoderKLFlux2.from_config(vae),
                "text_encoder (Mistral Small 3.1)": Mistral3ForConditionalGeneration(Mistral3Config(**text))}
    if kind == "flux2_klein":  # Qwen3ForCausalLM (4B for the 4B models, 8B for the 9B ones) and FLUX.2's VAE
        from diffusers import AutoencoderKLFlux2
        from transformers import Qwen3Config, Qwen3ForCausalLM

        vae = {k: v for k, v in (found.get("vae") or {}).items() if not k.startswith("_")}
        # the transformer reads three of the text encoder's hidden states side by side
        default = _QWEN3_8B if transformer_cfg.get("joint_attention_dim") == 3 * _QWEN3_8B["hidden_size"] else _QWEN3_4B
        text = found.get("text_encoder") or default
        text = {k: v for k, v in text.items() if not k.startswith("_")}
        return {"vae": AutoencoderKLFlux2.from_config(vae),
                "text_encoder (Qwen3)": Qwen3ForCausalLM(Qwen3Config(**text))}
    vae_config = {k: v for k, v in (found.get("vae") or SD3_VAE).items() if not k.startswith("_")}
    parts = {"vae": AutoencoderKL.from_config(vae_config)}
    if kind == "z_image":
        from transformers import Qwen3Config, Qwen3Model

        text = {k: v for k, v in (found.get("text_encoder") or _QWEN3_4B).items() if not k.startswith("_")}
        parts["text_encoder (Qwen3)"] = Qwen3Model(Qwen3Config(**text))
        return parts
    if kind == "sd3":
        parts["text_encoder (CLIP-L)"] = clip(found.get("text_encoder") or _CLIP_L, True)
        parts["text_encoder_2 (CLIP-G)"] = clip(found.get("text_encoder_2") or _CLIP_G, True)
        parts["text_encoder_3 (T5)"] = t5(found.get("text_encoder_3") or _T5_XXL)
    else:
        parts["text_encoder (CLIP-L)"] = clip(found.get("text_encoder") or _CLIP_L, False)
        parts["text_encoder_2 (T5)"] = t5(found.get("text_encoder_2") or _T5_XXL)
    return parts


def footprint(cfg: ModelConfig, *, resolution: int | None = None) -> Footprint | None:
    """The :class:`Footprint` of a ``model`` section (``ModelConfig``), or None when its architecture is
    unknown here (a hub id that is neither cached nor in :data:`KNOWN_MODELS`)."""
    if cfg.name == "shapes":
        return _shapes_footprint(cfg)
    kind, transformer_cfg, found, source = _configs(cfg)
    if transformer_cfg is None:
        return None
    import diffusers

    transformer_cfg = {k: v for k, v in transformer_cfg.items() if not k.startswith("_")}
    classes = {"sd3": "SD3Transformer2DModel", "flux": "FluxTransformer2DModel",
               "qwen_image": "QwenImageTransformer2DModel", "z_image": "ZImageTransformer2DModel",
               "wan": "WanTransformer3DModel", "flux2": "Flux2Transformer2DModel",
               "flux2_klein": "Flux2Transformer2DModel",
               "qwen_image_edit": "QwenImageTransformer2DModel", "flux_kontext": "FluxTransformer2DModel"}
    if kind not in classes:  # a family without a published architecture here
        return None
    with torch.device("meta"):
        cls = getattr(diffusers, classes[kind])
        denoiser = cls.from_config(transformer_cfg)
        parts = _text_and_vae(kind, found, transformer_cfg)
        second = found.get("transformer_2") if kind == "wan" else None  # Wan 2.2: the low-noise expert
        if second:
            parts = {"transformer_2": cls.from_config({k: v for k, v in second.items() if not k.startswith("_")}),
                     **parts}
    params = {"transformer": _count(denoiser), **{k: _count(m) for k, m in parts.items()}}
    experts = [denoiser] + ([parts["transformer_2"]] if "transformer_2" in parts else [])
    if cfg.lora is not None:
        from flowrl.models.lora_files import default_lora_targets

        targets = list(cfg.lora.target_modules) or default_lora_targets(kind)
        trainable = sum(_lora_params(expert, targets, cfg.lora.rank) for expert in experts)
    else:
        trainable = sum(_count(expert) for expert in experts)
    config = denoiser.config
    if kind == "wan":  # self-attention over the video's (1, 2, 2) patches; the text enters by cross-attention
        from flowrl.models.wan import WAN_DEFAULT_RESOLUTION

        height, width = ((resolution or cfg.resolution,) * 2 if (resolution or cfg.resolution)
                         else WAN_DEFAULT_RESOLUTION)
        frames = ((cfg.num_frames or 81) - 1) // 4 + 1
        tokens = frames * (height // 16) * (width // 16) + (cfg.max_sequence_length or 226)
        notes = [f"{cfg.num_frames or 81} frames ({frames} latent frames) at {height} x {width} px"]
        if second:
            notes.append("two experts: weights count both; each rollout step runs one of them")
        return Footprint(source, params, trainable, hidden=config.num_attention_heads * config.attention_head_dim,
                         layers=config.num_layers, tokens=tokens, notes=notes)
    res = resolution or cfg.resolution or 1024
    if kind == "z_image":  # one stream of image patches and caption tokens; the refiners run on each alone
        text = cfg.max_sequence_length or 512
        return Footprint(source, params, trainable, hidden=config.dim,
                         layers=config.n_layers + 2 * config.n_refiner_layers, tokens=(res // 16) ** 2 + text)
    hidden = config.num_attention_heads * config.attention_head_dim
    text = cfg.max_sequence_length or (256 if kind == "sd3" else 512)
    if kind == "sd3":
        image_tokens = (res // 8 // config.patch_size) ** 2
        tokens, layers = image_tokens + 77 + text, config.num_layers
    elif kind == "qwen_image":  # 2x2 packed latent tokens beside the text tokens, 60 dual-stream blocks
        tokens, layers = (res // 16) ** 2 + text, config.num_layers
    elif kind == "qwen_image_edit":  # the source's latent tokens too; the text holds the source's vision tokens
        vision = round(res / 28) ** 2  # Qwen2.5-VL: 14 px patches merged 2 x 2, the side rounded to 28 px
        tokens, layers = 2 * (res // 16) ** 2 + vision + text, config.num_layers
        notes = [f"the source image's {(res // 16) ** 2} latent tokens beside the noisy latent's and its {vision} "
                 "vision tokens in the text"]
        return Footprint(source, params, trainable, hidden=hidden, layers=layers, tokens=tokens, notes=notes)
    elif kind == "flux_kontext":  # the source's packed tokens beside the noisy latent's
        tokens, layers = 2 * (res // 16) ** 2 + text, config.num_layers + config.num_single_layers
    else:
        image_tokens = (res // 16) ** 2
        tokens, layers = image_tokens + text, config.num_layers + config.num_single_layers
    return Footprint(source, params, trainable, hidden=hidden, layers=layers, tokens=tokens)


def _shapes_footprint(cfg) -> Footprint:
    from flowrl.models.shapes import SHAPES_LORA_TARGETS, SHIPPED_CHECKPOINT, ShapesModel, ShapesModelConfig

    from flowrl.config import from_dict

    directory = Path(cfg.path) if cfg.path else SHIPPED_CHECKPOINT
    if (directory / "model" / "model.json").is_file():
        directory = directory / "model"
    meta = _read_config(directory / "model.json") or {}
    config = from_dict(ShapesModelConfig, meta.get("config") or {})
    with torch.device("meta"):
        model = ShapesModel.build(config)
    params = {"unet": _count(model.denoiser), "text_encoder": _count(model.text_encoder)}
    if cfg.lora is not None:
        targets = list(cfg.lora.target_modules) or SHAPES_LORA_TARGETS
        trainable = _lora_params(model.denoiser, targets, cfg.lora.rank)
    else:
        trainable = params["unet"]
    return Footprint(str(directory), params, trainable)


#: Parameters of the bundled reward models' default architectures (their ``__init__`` defaults), for the estimate:
#: PickScore is a transformers CLIPModel of CLIP-ViT-H-14 (laion2B), HPSv2 an open_clip ViT-H-14, clip_score,
#: aesthetic and clip_directional an open_clip ViT-L-14 (OpenAI's; the aesthetic MLP's 0.9M is left out).
#: Counted on the ``meta`` device from those configs.
REWARD_PARAMS = {"pickscore": 986_109_441, "hpsv2": 986_109_441, "clip_score": 427_616_513,
                 "aesthetic": 427_616_513, "clip_directional": 427_616_513}
# The keyword naming another architecture than the default, per reward (its estimate is then unknown).
_REWARD_ARCH_KWARG = {"pickscore": "model", "hpsv2": "model_name", "clip_score": "model_name",
                      "aesthetic": "model_name", "clip_directional": "model_name"}
# The keyword of each reward's precision and its value's bytes per parameter ("auto": bf16 on a GPU).
_REWARD_PRECISION = {"pickscore": ("dtype", "auto"), "hpsv2": ("precision", "auto"),
                     "clip_score": ("precision", "auto"), "aesthetic": ("precision", "fp32"),
                     "clip_directional": ("precision", "fp32")}
_PRECISION_BYTES = {"auto": 2, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}


def text_encoder_params(fp: Footprint) -> int:
    """Parameters of the footprint's text encoders (the parts named ``text_encoder*``)."""
    return sum(v for k, v in fp.params.items() if k.startswith("text_encoder"))


def reward_memory(reward_cfg: RewardConfig) -> dict[str, int]:
    """Bytes of device memory of every reward model a training process holds, one entry per built copy
    (``"pickscore (train, bf16)"``): the training reward's terms, each evaluation reward and each held-out reward
    are built separately (``rewards.config.RewardConfig``), so a reward named in two of them is held twice.

    Sized from :data:`REWARD_PARAMS` at the reward's precision on a GPU (its default ``"auto"`` is bfloat16 there:
    ``rewards._loading.auto_precision``); a reward whose kwargs place it on the CPU, name another architecture, or
    that has no weights here (shapes, jpeg, ocr, a remote server, ...) is left out.
    """
    out: dict[str, int] = {}

    def add(name: str, entry, role: str) -> None:
        if name == "gated" and isinstance(entry, dict):
            for side in ("alignment", "quality"):
                walk(entry.get(side), role)
            return
        options = entry if isinstance(entry, dict) else {}
        registered = options.get("reward", name)
        kwargs = options.get("kwargs") or {}
        if registered not in REWARD_PARAMS or str(kwargs.get("device", "")).startswith("cpu"):
            return
        if _REWARD_ARCH_KWARG[registered] in kwargs:
            return  # another architecture than the table's
        key, default = _REWARD_PRECISION[registered]
        precision = str(kwargs.get(key, default))
        bytes_per = _PRECISION_BYTES.get(precision, 4)
        label = f"{name} ({role}, {'bf16' if precision == 'auto' else precision})"
        out[label] = out.get(label, 0) + REWARD_PARAMS[registered] * bytes_per

    def walk(spec, role: str) -> None:
        if isinstance(spec, str):
            for name in spec.split(","):
                add(name.split(":")[0].strip(), 1.0, role)
        elif isinstance(spec, (list, tuple)):
            for item in spec:
                walk(item, role)
        elif isinstance(spec, dict):
            for name, entry in spec.items():
                add(str(name), entry, role)

    train = reward_cfg.train or {}
    walk(train, "train")
    for name in reward_cfg.eval or []:
        add(name, train.get(name, 1.0) if isinstance(train, dict) else 1.0, "eval")
    for item in reward_cfg.heldout or []:
        walk(item, "held out")
    return out


def memory_estimate(cfg: ModelConfig, fp: Footprint, *, micro_batch: int, guidance: bool, ema: bool,
                    reference: bool = True, snapshots: int = 0, rewards: float = 0.0,
                    fake_score: bool = False, teacher: bool = False) -> dict[str, float]:
    """A rough GiB budget of one training process (one GPU under DDP; FSDP2 divides the weights and
    training state by the number of processes, ZeRO-2 the optimizer state and gradients).

    - weights: the denoiser in ``model.dtype`` (LoRA), or in float32 for full fine-tuning (float32 master
      weights, :meth:`flowrl.models.base.FlowModel.keep_float32_master_weights`); the text encoders in
      ``model.dtype`` unless ``model.offload_text_encoders`` keeps them on the CPU (diffusers families); the VAE in
      float32 (flowrl's default);
    - training state: gradients and AdamW's two moments of the trained tensors, all float32 (LoRA weights are kept
      in float32 and counted here too);
    - reference copy (full fine-tuning, when the run uses the reference: ``reference``): the denoiser in
      ``model.dtype``; a LoRA's reference is its adapters off, free;
    - EMA (``train.ema_decay``): a float32 copy of the trained tensors (diffusers' ``EMAModel`` of the float32
      trained weights); snapshots: ``snapshots`` more float32 copies (``flowrl.rl.param_snapshots.ParamSnapshot``: NFT's
      old model, CRD's two, DGPO's and AWM's EMA snapshot, elastic reset's two);
    - fake score (``fake_score``: DMD2, DMDR; :class:`flowrl.recipes.dmd2.FakeScore`): a second float32 copy of the
      trained tensors, trained by its own AdamW: its weights, gradients and two moments, as the training state of a
      LoRA (a full fine-tune's fake score is a whole second denoiser in float32 with its optimizer);
    - teacher (``teacher``: on-policy distillation, ``train.teacher``; flowrl/rl/teacher.py): a second frozen
      denoiser in ``model.dtype``, as the reference copy;
    - rewards: ``rewards`` bytes of reward models (:func:`reward_memory`);
    - activations of one training micro-batch (two rows per sample with classifier-free guidance): about
      ``34 tokens x hidden`` bytes per 16-bit block (Korthikanti et al. 2022, with memory-efficient attention),
      every block's with full activations, one block's plus every block's input with gradient checkpointing.

    - text encoders lent to encode: with ``model.offload_text_encoders``, the text encoders in ``model.dtype``,
      on the device only while new prompts are encoded.

    ``total`` is every resident part plus the larger of the activations and the lent text encoders (never on the
    device together: prompts are encoded between training steps), so it is less than the sum of the entries when
    both are present.
    """
    gib = 2 ** 30
    b = _BYTES[cfg.dtype]
    denoiser = fp.params.get("transformer", 0) + fp.params.get("transformer_2", 0) + fp.params.get("unet", 0)
    text = text_encoder_params(fp)
    offloaded = cfg.offload_text_encoders and cfg.name != "shapes"
    lora = cfg.lora is not None
    out = {"weights": (denoiser * (b if lora else 4) + (0 if offloaded else text * b)
                       + fp.params.get("vae", 0) * 4) / gib}
    # LoRA: its float32 weights, their gradients, AdamW's two moments; full fine-tuning: float32 gradients and moments
    out["training state"] = fp.trainable * 4 * (4 if lora else 3) / gib
    if reference and not lora:
        out["reference copy"] = denoiser * b / gib
    if ema:
        out["EMA"] = fp.trainable * 4 / gib
    if snapshots:
        out["snapshots"] = snapshots * fp.trainable * 4 / gib
    if fake_score:
        out["fake score"] = fp.trainable * 4 * 4 / gib
    if teacher:
        out["teacher"] = denoiser * b / gib
    if rewards:
        out["rewards"] = rewards / gib
    resident = sum(out.values())
    acts = 0.0
    if fp.hidden and fp.layers and fp.tokens:
        rows = micro_batch * (2 if guidance else 1)
        per_block = 34 * fp.tokens * fp.hidden * (b / 2) * rows
        if cfg.gradient_checkpointing:
            acts = per_block + fp.layers * fp.tokens * fp.hidden * b * rows
        else:
            acts = per_block * fp.layers
        out["activations"] = acts / gib
    if offloaded and text:
        out["text encoders lent to encode"] = text * b / gib
    # the text encoders are lent between training steps (rollout batches with new prompts): never beside the
    # training step's activations
    out["total"] = resident + max(acts / gib, out.get("text encoders lent to encode", 0.0))
    return out


def weights_status(cfg: ModelConfig) -> tuple[bool, str]:
    """``(present, where)`` of the weights a ``model`` section names (without downloading anything)."""
    if cfg.name == "shapes":
        return True, str(cfg.path or "the shipped shapes model")
    path = Path(str(cfg.path)).expanduser()
    if path.is_dir():
        ok = (path / "model_index.json").is_file()
        return ok, str(path) + ("" if ok else " (no model_index.json)")
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(str(cfg.path), "model_index.json")
    except Exception:  # noqa: BLE001
        hit = None
    if isinstance(hit, str):
        return True, f"{cfg.path} (Hugging Face cache)"
    return False, (f"{cfg.path}: not downloaded; `huggingface-cli download {cfg.path} --local-dir DIR` on a machine "
                   "with internet (accept the license first for gated models), then model.path=DIR")


def _ceil(x: float) -> float:
    return math.ceil(x * 10) / 10


def format_gib(x: float) -> str:
    return f"{_ceil(x):.1f} GiB"
