"""Tiny but real Stable Diffusion 3 and FLUX.1 pipelines, built offline from configs.

Every component is the real diffusers / transformers class (``SD3Transformer2DModel``,
``FluxTransformer2DModel``, ``AutoencoderKL``, ``CLIPTextModelWithProjection``, ``CLIPTextModel``,
``T5EncoderModel``, ``CLIPTokenizer``, ``T5TokenizerFast``, ``FlowMatchEulerDiscreteScheduler``) with
a few thousand parameters, and the tokenizers are built locally (a tiny character-level BPE for CLIP,
a tiny Unigram for T5), so nothing is downloaded. The pipelines are written with ``save_pretrained``
so that tests exercise the real loading code (``SD3Model.from_pretrained(directory)``).

Public API::

    from flowrl.testing import build_tiny_sd3, build_tiny_flux
    path = build_tiny_sd3()            # cached per user and library version; or build_tiny_sd3(tmp_path)
    model = SD3Model.from_pretrained(path, resolution=TINY_RESOLUTION, max_sequence_length=TINY_MAX_SEQUENCE_LENGTH)

The tiny models keep the real structure where it matters to an adapter: 16 latent channels, a VAE
with 4 resolution levels (scale factor 8, like the real VAEs) and the real scaling/shift factors,
patch size 2 (SD3) / 2x2 packing (FLUX), the real scheduler configs (SD3.5: shift 3; FLUX-dev:
dynamic shifting), FLUX's guidance embedding, and every module name a default LoRA target names.
Weights are drawn from a fixed seed, so two builds are identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
import uuid
from pathlib import Path

import torch

__all__ = ["build_tiny", "TINY_FAMILIES", "build_tiny_sd3", "build_tiny_flux", "tiny_pipeline_components",
           "TINY_RESOLUTION", "TINY_MAX_SEQUENCE_LENGTH", "TINY_CLIP_MAX_LENGTH"]

#: Image side length the tiny pipelines are meant for: 64 px -> 8x8 latents (16 FLUX tokens).
TINY_RESOLUTION = 64
#: A short T5 sequence keeps tiny runs fast; pass it as ``max_sequence_length`` when loading.
TINY_MAX_SEQUENCE_LENGTH = 16
#: CLIP tokenizers' ``model_max_length`` (77 in the real models).
TINY_CLIP_MAX_LENGTH = 16

# Bump when a config below changes, so the per-user cache is rebuilt.
_BUILD_VERSION = 1

_CHARS = string.ascii_lowercase + string.digits + ".,!?'-"
_WORDS = ["a", "an", "the", "of", "and", "on", "in", "red", "green", "blue", "cat", "dog", "circle",
          "square", "triangle", "photo", "big", "small"]

# Real VAE factors: SD3 / SD3.5 and FLUX.1.
_SD3_VAE_FACTORS = {"scaling_factor": 1.5305, "shift_factor": 0.0609}
_FLUX_VAE_FACTORS = {"scaling_factor": 0.3611, "shift_factor": 0.1159}


# ---------------------------------------------------------------------------------------- tokenizers


def _clip_tokenizer(workdir: Path):
    """A CLIP BPE tokenizer over single characters plus a few whole-word merges.

    Written as ``vocab.json`` + ``merges.txt`` (the files a real CLIP tokenizer ships) and loaded with
    ``CLIPTokenizer.from_pretrained``, which works on transformers 4 and 5 alike.
    """
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    merges: list[str] = []
    for word in _WORDS:  # merge left to right: c a -> ca, ca t</w> -> cat</w>
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:
            a, b = symbols[0], symbols[1]
            if f"{a} {b}" not in merges:
                merges.append(f"{a} {b}")
            vocab.setdefault(a + b, len(vocab))
            symbols = [a + b] + symbols[2:]
    directory = workdir / "clip_tokenizer_src"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return CLIPTokenizer.from_pretrained(str(directory), model_max_length=TINY_CLIP_MAX_LENGTH)


def _t5_tokenizer():
    """A T5 tokenizer: a Unigram model over characters and a few words, built with ``tokenizers``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    for c in _CHARS:
        pieces += [("\u2581" + c, -3.0), (c, -4.0)]
    pieces += [("\u2581" + w, -1.0) for w in _WORDS if len(w) > 1]
    backend = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=0, model_max_length=512)


# ---------------------------------------------------------------------------------------- encoders


def _clip_text_model(vocab_size: int, hidden: int, projection: int | None, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=2, num_attention_heads=2,
                            max_position_embeddings=TINY_CLIP_MAX_LENGTH, projection_dim=projection or hidden,
                            bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_act="gelu")
    torch.manual_seed(seed)
    cls = CLIPTextModelWithProjection if projection is not None else CLIPTextModel
    return cls(config).eval()


def _t5_encoder(vocab_size: int, d_model: int, seed: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                      num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                      feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)
    torch.manual_seed(seed)
    return T5EncoderModel(config).eval()


def _vae(factors: dict[str, float], seed: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4, latent_channels=16,
        sample_size=TINY_RESOLUTION, use_quant_conv=False, use_post_quant_conv=False, **factors,
    ).eval()


# ---------------------------------------------------------------------------------------- pipelines


def tiny_pipeline_components(kind: str, workdir: str | Path) -> dict:
    """The components of a tiny ``"sd3"`` or ``"flux"`` pipeline (keyword arguments of its constructor).

    Args:
        kind: ``"sd3"`` (``StableDiffusion3Pipeline``, SD3.5-style: qk RMS norm, shift 3) or ``"flux"``
            (``FluxPipeline``, FLUX.1-dev-style: guidance embedding, dynamic shifting).
        workdir: scratch directory for the tokenizer source files.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    workdir = Path(workdir)
    with torch.random.fork_rng(devices=[]):
        clip_tok = _clip_tokenizer(workdir)
        t5_tok = _t5_tokenizer()
        clip_vocab, t5_vocab = len(clip_tok), len(t5_tok)
        if kind == "sd3":
            from diffusers import SD3Transformer2DModel

            torch.manual_seed(0)
            transformer = SD3Transformer2DModel(
                sample_size=TINY_RESOLUTION // 8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
                pooled_projection_dim=16, pos_embed_max_size=16, qk_norm="rms_norm",
            ).eval()
            return dict(
                transformer=transformer,
                scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
                vae=_vae(_SD3_VAE_FACTORS, seed=1),
                # CLIP-L / CLIP-G: hidden 8 + 8 = 16 <= T5 width 32 (the pipeline pads CLIP to the T5 width);
                # pooled = projection 8 + 8 = the transformer's pooled_projection_dim.
                text_encoder=_clip_text_model(clip_vocab, hidden=8, projection=8, seed=2),
                tokenizer=clip_tok,
                text_encoder_2=_clip_text_model(clip_vocab, hidden=8, projection=8, seed=3),
                tokenizer_2=_clip_tokenizer(workdir),
                text_encoder_3=_t5_encoder(t5_vocab, d_model=32, seed=4),
                tokenizer_3=t5_tok,
            )
        if kind == "flux":
            from diffusers import FluxTransformer2DModel

            torch.manual_seed(0)
            transformer = FluxTransformer2DModel(
                patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=8,
                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
                axes_dims_rope=(2, 2, 4),
            ).eval()
            return dict(
                transformer=transformer,
                scheduler=FlowMatchEulerDiscreteScheduler(
                    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096),
                vae=_vae(_FLUX_VAE_FACTORS, seed=1),
                text_encoder=_clip_text_model(clip_vocab, hidden=16, projection=None, seed=2),
                tokenizer=clip_tok,
                text_encoder_2=_t5_encoder(t5_vocab, d_model=32, seed=4),
                tokenizer_2=t5_tok,
            )
    raise ValueError(f"unknown tiny pipeline kind {kind!r}; valid: 'sd3', 'flux'")


#: Tiny pipelines of the other families: kind -> (diffusers pipeline class name, "module:components function").
#: Each family keeps its tiny components in its own module of flowrl.testing.
TINY_FAMILIES = {
    "qwen_image": ("QwenImagePipeline", "flowrl.testing.tiny_qwen_image:qwen_image_components"),
    "z_image": ("ZImagePipeline", "flowrl.testing.tiny_z_image:z_image_components"),
    "flux2_klein": ("Flux2KleinPipeline", "flowrl.testing.tiny_flux2:flux2_klein_components"),
    "flux2": ("Flux2Pipeline", "flowrl.testing.tiny_flux2_dev:flux2_dev_components"),
    "flux_kontext": ("FluxKontextPipeline", "flowrl.testing.tiny_flux_kontext:flux_kontext_components"),
    "qwen_image_edit": ("QwenImageEditPipeline", "flowrl.testing.tiny_qwen_image_edit:qwen_image_edit_components"),
    "wan": ("WanPipeline", "flowrl.testing.tiny_wan:wan_components"),
    "wan22": ("WanPipeline", "flowrl.testing.tiny_wan:wan22_components"),
}


def _components(kind: str, workdir: Path) -> tuple[type, dict]:
    """``(pipeline class, constructor keywords)`` of the tiny pipeline ``kind``."""
    import importlib

    import diffusers

    if kind in ("sd3", "flux"):
        cls = diffusers.StableDiffusion3Pipeline if kind == "sd3" else diffusers.FluxPipeline
        return cls, tiny_pipeline_components(kind, workdir)
    if kind not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; valid: sd3, flux, {', '.join(TINY_FAMILIES)}")
    class_name, target = TINY_FAMILIES[kind]
    module, function = target.split(":")
    return getattr(diffusers, class_name), getattr(importlib.import_module(module), function)(workdir)


def build_tiny(kind: str, path: str | Path | None = None) -> Path:
    """Build the tiny pipeline of family ``kind`` (``sd3``, ``flux`` or a key of :data:`TINY_FAMILIES`) and
    ``save_pretrained`` it to ``path`` (None: a per-user cache directory, built once). Returns the directory."""
    return _build(kind, path)


def _build(kind: str, path: str | Path | None) -> Path:
    if path is None:
        path = _cache_dir() / kind
        if (path / "model_index.json").is_file():
            return path
    path = Path(path)
    # Build beside the target and rename into place: concurrent builders (2-process tests) never see a
    # half-written directory, and the first rename wins.
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.{uuid.uuid4().hex}"
    try:
        cls, components = _components(kind, staging / "_work")
        cls(**components).save_pretrained(str(staging), safe_serialization=True)
        shutil.rmtree(staging / "_work", ignore_errors=True)
        if path.exists() and (path / "model_index.json").is_file() and path.parent == _cache_dir():
            return path  # another process finished first
        if path.exists():
            shutil.rmtree(path)
        try:
            os.replace(staging, path)
        except OSError:  # lost a race to a concurrent builder of the same cache entry
            if not (path / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _cache_dir() -> Path:
    import diffusers
    import transformers

    key = f"{_BUILD_VERSION}-{diffusers.__version__}-{transformers.__version__}-{torch.__version__}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    user = os.environ.get("USER") or str(os.getuid() if hasattr(os, "getuid") else "user")
    return Path(tempfile.gettempdir()) / f"flowrl-tiny-pipelines-{user}" / digest


def build_tiny_sd3(path: str | Path | None = None) -> Path:
    """Build a tiny ``StableDiffusion3Pipeline`` and ``save_pretrained`` it.

    Args:
        path: directory to write (replaced if it exists). ``None``: a per-user cache directory under the
            system temp dir, keyed by the library versions, built once and reused.

    Returns:
        The directory, loadable with ``SD3Model.from_pretrained(path)`` or
        ``StableDiffusion3Pipeline.from_pretrained(path)``.
    """
    return _build("sd3", path)


def build_tiny_flux(path: str | Path | None = None) -> Path:
    """Build a tiny ``FluxPipeline`` (guidance-distilled, like FLUX.1-dev) and ``save_pretrained`` it.

    Args:
        path: directory to write (replaced if it exists). ``None``: a per-user cached directory.

    Returns:
        The directory, loadable with ``FluxModel.from_pretrained(path)``.
    """
    return _build("flux", path)
