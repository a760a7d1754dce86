"""The model-adapter interface: a generator seen as a velocity model.

Every recipe talks to generators only through :class:`FlowModel`, so the same loop trains the tiny
shapes model, Stable Diffusion 3 and FLUX.1. An adapter

- encodes prompts once per unique prompt into a ``Cond``: a dict of tensors, batch first, kept in a
  bounded least-recently-used cache on the CPU (``prompt_cache_size`` prompts; about 1.7 MB each for SD3 at
  128 T5 tokens in bfloat16) and moved to the model's device per batch;
- predicts the velocity ``v = eps - x0`` at ``(x, sigma, cond)`` in flowrl's time convention
  (sigma = 1 noise, sigma = 0 data), converting from the backbone's own convention;
- decodes latents to images ``[B, 3, H, W]`` in [0, 1];
- owns the trainable parameters (full fine-tuning or LoRA through peft) and a reference context
  (LoRA adapters off, or a frozen copy for full fine-tuning, made only when the run uses the reference:
  :meth:`FlowModel.freeze_reference`);
- for full fine-tuning of a 16-bit model, keeps float32 master weights on request
  (:meth:`FlowModel.keep_float32_master_weights`), so AdamW never steps bfloat16 weights.

The trained network is ``self.denoiser``. Distributed recipes may replace it with the module that
``accelerator.prepare`` returns; adapters always call ``self.denoiser`` and unwrap it where they need
the plain module.
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import contextlib
import copy
from collections import OrderedDict
from typing import Callable, Iterator

import torch
from torch import nn

from flowrl.config import LoraConfig

Cond = dict[str, torch.Tensor]  # each value [B, ...]
VelocityFn = Callable[[torch.Tensor, torch.Tensor, Cond], torch.Tensor]

__all__ = ["Cond", "VelocityFn", "FlowModel", "ModelLoadError", "ReferenceUnavailableError",
           "cond_select", "cond_cat",
           "encode_rows", "source_tensor", "source_digest",
           "unwrap", "DEFAULT_PROMPT_CACHE_SIZE", "ATTENTION_BACKENDS", "check_attention_backend"]

#: Prompts the text-conditioning cache keeps by default (least recently used evicted first).
DEFAULT_PROMPT_CACHE_SIZE = 1024


class ModelLoadError(FlowrlError, RuntimeError):
    """A model could not be loaded (missing weights offline, wrong path); the message says the fix."""


class ReferenceUnavailableError(RuntimeError):
    """:meth:`FlowModel.reference` was entered on a full fine-tune that keeps no reference copy (the run declared
    that nothing uses the reference); predicting with the live weights instead would be silently wrong."""


def unwrap(module: nn.Module) -> nn.Module:
    """The plain module under DDP / FSDP / torch.compile wrappers."""
    while True:
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        if inner is None or not isinstance(inner, nn.Module):
            return module
        module = inner


def cond_select(cond: Cond, index: torch.Tensor | slice | list[int]) -> Cond:
    """Rows ``index`` of every tensor in a Cond."""
    return {k: v[index] for k, v in cond.items()}


def encode_rows(model, prompts: list[str], metadata: list[dict] | None) -> Cond:
    """``model``'s Cond for prompts with their prompt-set rows: the rows reach ``encode_prompts`` only for an
    editing model (:attr:`FlowModel.conditions_on_source`), so every other model is called as before."""
    if getattr(model, "conditions_on_source", False):
        return model.encode_prompts(prompts, metadata)
    return model.encode_prompts(prompts)


def source_tensor(value, *, index: int = 0, model: str = "this model") -> torch.Tensor:
    """An editing prompt's source image as ``[3, H, W]`` float32 in [0, 1]: a tensor of that shape (or
    ``[1, 3, H, W]``) or a PIL image. A ValueError naming the row and the fix otherwise."""
    if value is not None and not isinstance(value, torch.Tensor) and hasattr(value, "convert"):  # PIL
        import numpy as np

        value = torch.from_numpy(np.asarray(value.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)
    if isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[0] == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor) or value.dim() != 3 or value.shape[0] != 3:
        got = "no source_image" if value is None else f"a {type(value).__name__}" + (
            f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
        raise ValueError(f"prompt {index}: {model} edits a source image and got {got}; give editing prompts "
                         f"(webdataset shards of <key>.src.png + <key>.txt, flowrl.data.edit_prompts) whose "
                         f"metadata has source_image, a [3, H, W] tensor in [0, 1] or a PIL image")
    return value.detach().float().cpu().contiguous()


def source_digest(image: torch.Tensor) -> str:
    """A content hash of a source image ``[3, H, W]`` (its shape and float32 bytes): the cache key's image part."""
    import hashlib

    digest = hashlib.sha1(str(tuple(image.shape)).encode())
    digest.update(image.float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def cond_cat(conds: list[Cond]) -> Cond:
    """Concatenate Conds along the batch."""
    return {k: torch.cat([c[k] for c in conds]) for k in conds[0]}


class GuidanceEmbedded:
    """``velocity_fn`` of a guidance-distilled model (FLUX.1 dev, FLUX.2 [dev]): the scale goes into the guidance
    embedding of ``_predict(denoiser, x, sigma, cond, guidance=)``, no CFG branch runs (so ``detach_uncond`` has
    nothing to detach). Mixed in before :class:`FlowModel`."""

    def velocity_fn(self, guidance_scale: float | None = None, *, detach_uncond: bool = False) -> VelocityFn:
        """``velocity_fn(x, sigma, cond)`` with ``guidance_scale`` in the guidance embedding."""
        scale = self.default_guidance if guidance_scale is None else float(guidance_scale)
        if scale == self.default_guidance:
            return self.velocity

        def velocity(x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
            sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).expand(x.shape[0])
            with self._master_autocast(x):
                return self._predict(self.denoiser, x, sigma, cond, guidance=scale).float()

        return velocity


class FlowModel(nn.Module):
    """Base class of model adapters. Subclasses implement ``_encode``, ``_predict`` and ``decode``.

    Attributes:
        denoiser: the network that is trained (UNet or transformer).
        latent_shape: ``(C, H, W)`` of one latent; ``(C, F, H, W)`` for a video model (a frame axis), whose
            ``decode`` gives frames ``[B, F_pixels, 3, H, W]`` instead of images ``[B, 3, H, W]``.
        uses_cfg: classifier-free guidance applies (False for guidance-distilled FLUX).
        conditions_on_source: an editing model (a source image beside each prompt).
        default_guidance: the guidance scale used when a recipe does not set one.
    """

    latent_shape: tuple[int, ...]
    uses_cfg: bool = True
    #: The model edits a source image: ``encode_prompts`` needs each row's ``metadata["source_image"]`` and
    #: ``_encode(prompts, sources)`` receives them (``[3, H, W]`` float32 in [0, 1] each).
    conditions_on_source: bool = False
    default_guidance: float = 1.0

    def __init__(self, denoiser: nn.Module, *, lora: LoraConfig | None = None,
                 gradient_checkpointing: bool = False):
        super().__init__()
        self.denoiser = denoiser
        self._prompt_cache: OrderedDict[str, Cond] = OrderedDict()
        self.prompt_cache_size = DEFAULT_PROMPT_CACHE_SIZE
        self.prompt_cache_device: str = "cpu"  # "cpu", or "model": kept on the model's device
        self._reference: nn.Module | None = None
        # keep_float32_master_weights: {parameter name: its 16-bit dtype} and that dtype (None: not upcast)
        self._master_dtypes: dict[str, torch.dtype] = {}
        self._autocast_dtype: torch.dtype | None = None
        self.lora = lora
        if gradient_checkpointing:
            self.denoiser.enable_gradient_checkpointing()
        if lora is not None:
            self._add_lora(lora)
        else:
            self.denoiser.requires_grad_(True)

    # ------------------------------------------------------------------ subclass hooks

    def _encode(self, prompts: list[str]) -> Cond:
        """Encode unique prompts (no caching here) into a Cond with batch ``len(prompts)``. Editing models
        (:attr:`conditions_on_source`) take ``_encode(prompts, sources)``, one ``[3, H, W]`` source each."""
        raise NotImplementedError

    def _predict(self, denoiser: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """The velocity ``eps - x0`` predicted by ``denoiser`` at ``x [B, C, H, W]``, ``sigma [B]``."""
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, H, W]`` -> images ``[B, 3, H', W']`` float32 in [0, 1]."""
        raise NotImplementedError

    def default_lora_targets(self) -> list[str]:
        """Module names LoRA adapts when the config names none."""
        raise NotImplementedError

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The model's sampling schedule ``[num_steps + 1]`` from 1 to 0 (subclasses add shifts)."""
        from samplers import linear_sigmas

        return linear_sigmas(num_steps)

    # ------------------------------------------------------------------ prompts

    @property
    def device(self) -> torch.device:
        return next(unwrap(self.denoiser).parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the denoiser computes in (its weights' dtype; the 16-bit one when float32 master weights
        are kept: :meth:`keep_float32_master_weights`)."""
        return self._autocast_dtype or next(unwrap(self.denoiser).parameters()).dtype

    def set_prompt_cache(self, size: int = DEFAULT_PROMPT_CACHE_SIZE, device: str = "cpu") -> None:
        """Bound the prompt cache to ``size`` prompts (0: no cache), kept on ``device`` (``"cpu"``, or
        ``"model"`` for the model's own device: no copy per batch, device memory per prompt)."""
        if size < 0 or device not in ("cpu", "model"):
            raise ValueError(f"prompt cache: size >= 0 and device 'cpu' or 'model', got {size}, {device!r}")
        self.prompt_cache_size, self.prompt_cache_device = int(size), device
        self._evict()

    def _evict(self) -> None:
        while len(self._prompt_cache) > self.prompt_cache_size:
            self._prompt_cache.popitem(last=False)  # the least recently used

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], metadata: list[dict] | None = None) -> Cond:
        """Cond for ``prompts`` (batch ``len(prompts)``) on the model's device, encoding each unique prompt
        not in the cache once (one batched call) and caching it (least recently used evicted first).

        ``metadata``: one dict per prompt (the prompt set's rows). Models that condition on a source image
        (:attr:`conditions_on_source`, the editing models) read each row's ``"source_image"`` and key their
        cache on the prompt and a hash of the source; every other model ignores it."""
        if not self.conditions_on_source:
            return self._encode_cached(prompts, prompts, None)
        sources = [source_tensor(row.get("source_image") if isinstance(row, dict) else None, index=i,
                                 model=type(self).__name__) for i, row in enumerate(metadata or [None] * len(prompts))]
        if len(sources) != len(prompts):
            raise ValueError(f"encode_prompts: {len(prompts)} prompts but {len(sources)} metadata rows")
        keys = [f"{p}\x00{source_digest(s)}" for p, s in zip(prompts, sources)]
        return self._encode_cached(prompts, keys, sources)

    def _encode_cached(self, prompts: list[str], keys: list[str], sources: list[torch.Tensor] | None) -> Cond:
        rows: dict[str, Cond] = {}
        for key in dict.fromkeys(keys):
            if key in self._prompt_cache:
                self._prompt_cache.move_to_end(key)
                rows[key] = self._prompt_cache[key]
        first: dict[str, int] = {}  # each uncached key's first row
        for i, key in enumerate(keys):
            if key not in rows and key not in first:
                first[key] = i
        missing = list(first.values())
        if missing:
            texts = [prompts[i] for i in missing]
            with self._text_encoders_on_device():
                encoded = self._encode(texts) if sources is None else self._encode(texts, [sources[i] for i in missing])
            keep = self.device if self.prompt_cache_device == "model" else torch.device("cpu")
            for j, i in enumerate(missing):
                # clone: a row must not keep the whole batch's storage alive in the cache
                rows[keys[i]] = {k: v[j : j + 1].detach().to(keep).clone() for k, v in encoded.items()}
                if self.prompt_cache_size:
                    self._prompt_cache[keys[i]] = rows[keys[i]]
            self._evict()
        device = self.device
        return {k: v.to(device, non_blocking=True) for k, v in cond_cat([rows[key] for key in keys]).items()}

    def _text_encoders_on_device(self) -> contextlib.AbstractContextManager:
        """The context in which ``_encode`` runs: a no-op here; adapters whose text encoders are offloaded to the CPU
        (:meth:`flowrl.models.pipeline_model.PipelineModel.set_text_encoder_offload`) lend them to the device."""
        return contextlib.nullcontext()

    def uncond(self, batch_size: int = 1) -> Cond:
        """The empty-prompt Cond repeated ``batch_size`` times (for classifier-free guidance)."""
        return self.encode_prompts([""] * batch_size)

    def clear_prompt_cache(self) -> None:
        self._prompt_cache.clear()

    # ------------------------------------------------------------------ velocity

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Conditional velocity of the current policy, float32 ``[B, C, H, W]``."""
        sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).expand(x.shape[0])
        with self._master_autocast(x):
            return self._predict(self.denoiser, x, sigma, cond).float()

    def velocity_fn(self, guidance_scale: float | None = None, *, detach_uncond: bool = False) -> VelocityFn:
        """``velocity_fn(x, sigma, cond)`` with classifier-free guidance applied when the model uses it.

        ``detach_uncond``: no gradient through the unconditional branch (Flow-GRPO's training; see
        ``samplers.classifier_free_guidance``)."""
        scale = self.default_guidance if guidance_scale is None else guidance_scale
        if not self.uses_cfg or scale == 1.0:
            return self.velocity
        from samplers import classifier_free_guidance

        return classifier_free_guidance(self.velocity, self.uncond(1), scale, detach_uncond=detach_uncond)

    # ------------------------------------------------------------------ attention

    def set_attention_backend(self, backend: str) -> None:
        """Run the denoiser's attention with ``backend`` (docs/distributed.md, "Attention backends").

        - ``native``: PyTorch's scaled-dot-product attention (on CUDA it picks its FlashAttention or
          memory-efficient kernel itself);
        - ``xformers``: xformers' memory-efficient kernel (CUDA): diffusers' attention dispatcher where the
          model's attention goes through it (FLUX), its xformers processors otherwise (SD3's joint attention,
          the shapes UNet);
        - ``flash``: the flash-attn package through diffusers' attention dispatcher (FLUX).

        Raises:
            ConfigError: the backend cannot run here (no CUDA device, package missing, or a model whose
                attention does not go through the dispatcher); the message names the fix.
        """
        check_attention_backend(backend, self.device)
        module = unwrap(self.denoiser)
        dispatched = _uses_attention_dispatcher(module)
        if backend == "native":
            if dispatched:
                module.reset_attention_backend()
            return
        if backend == "xformers":
            if dispatched:
                module.set_attention_backend("xformers")
            else:
                module.enable_xformers_memory_efficient_attention()
            return
        if not dispatched:
            from flowrl.config import ConfigError

            raise ConfigError("model.attention_backend", f"flash: {type(module).__name__}'s attention does not go "
                              "through diffusers' attention dispatcher in this diffusers version; use native (PyTorch "
                              "SDPA runs its own FlashAttention kernel on CUDA for bfloat16 / float16) or xformers")
        module.set_attention_backend("flash")

    # ------------------------------------------------------------------ training state

    def _add_lora(self, lora: LoraConfig) -> None:
        from peft import LoraConfig as PeftLoraConfig

        targets = list(lora.target_modules) or self.default_lora_targets()
        self.denoiser.requires_grad_(False)
        # Gaussian down projections, as diffusers' LoRA training scripts initialise them.
        config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                target_modules=targets, init_lora_weights="gaussian")
        unwrap(self.denoiser).add_adapter(config)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The trained parameters (under FSDP2 the sharded ones, which the optimizer holds)."""
        module = unwrap(self.denoiser)
        _reshard(module)
        return [p for p in module.parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Only the trained tensors (LoRA weights, or the whole denoiser), detached on CPU."""
        module = unwrap(self.denoiser)
        names = {n for n, p in module.named_parameters() if p.requires_grad}
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k in names}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        module = unwrap(self.denoiser)
        expected = {n for n, p in module.named_parameters() if p.requires_grad}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state))[:3], sorted(set(state) - expected)[:3]
            raise ModelLoadError(f"checkpoint does not match the model's trainable parameters "
                                 f"(missing e.g. {missing}, unexpected e.g. {extra}); was it saved with the "
                                 f"same model and LoRA settings?")
        module.load_state_dict(state, strict=False)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Inside this context the adapter predicts with the reference model.

        LoRA: the same network with its adapters disabled (always available, no copy). Full fine-tuning: the
        frozen copy that :meth:`freeze_reference` took before training started; a full fine-tune without one
        raises :class:`ReferenceUnavailableError` rather than predicting with the live weights. Re-entrant: a
        nested ``reference()`` (the base model's tail steps of a base-model drawing, flowrl/rl/base_tail.py)
        leaves the outer one in force.

        Raises:
            ReferenceUnavailableError: full fine-tuning and no reference copy was kept.
        """
        if self.__dict__.get("_in_reference", False):
            yield
            return
        self.__dict__["_in_reference"] = True
        try:
            with self._reference_weights():
                yield
        finally:
            self.__dict__["_in_reference"] = False

    @property
    def has_reference(self) -> bool:
        """Whether :meth:`reference` can be entered: always with LoRA, after :meth:`freeze_reference` otherwise."""
        return self.lora is not None or self._reference is not None

    @contextlib.contextmanager
    def _reference_weights(self) -> Iterator[None]:
        if self.lora is not None:
            module = unwrap(self.denoiser)
            module.disable_adapters()
            try:
                yield
            finally:
                module.enable_adapters()
            return
        if self._reference is None:
            raise ReferenceUnavailableError(
                f"{type(self).__name__} is fully fine-tuned and keeps no reference copy: the run declared that nothing "
                "uses the reference (e.g. train.kl_coef = 0, no base_last_steps, no evaluation of the base model), so "
                "the copy was skipped to save memory; a recipe whose objective uses the reference declares it "
                "(ImageTraining(..., reference=True)), and code outside a recipe calls model.freeze_reference() before "
                "training")
        with self._swapped_denoiser(self._reference):
            yield

    @contextlib.contextmanager
    def _swapped_denoiser(self, module: nn.Module) -> Iterator[None]:
        """Inside this context the adapter predicts with ``module`` (a frozen full denoiser of the same architecture:
        the reference copy or the teacher) in place of the trained one, which is put back on exit."""
        trained = self.denoiser
        self.denoiser = module
        try:
            yield
        finally:
            self.denoiser = trained

    def freeze_reference(self) -> None:
        """Keep a frozen copy of the current weights as the reference (full fine-tuning only; LoRA's reference is
        the network with its adapters off, and this is a no-op).

        The copy is in the weights' original dtype even after :meth:`keep_float32_master_weights` (the loaded
        16-bit values, exactly), and parameters are copied one by one in that dtype, so no float32 copy of the
        whole denoiser is ever made. Costs one denoiser's weights of device memory (24 GB for FLUX.1 in
        bfloat16): call it only when the run uses the reference (:class:`flowrl.rl.setup.ImageTraining` decides).
        """
        if self.lora is not None or self._reference is not None:
            return
        module = unwrap(self.denoiser)
        # deepcopy with the parameters pre-copied: each in its original dtype, never requiring grad
        memo = {id(p): nn.Parameter(p.detach().to(dtype=self._master_dtypes.get(name, p.dtype), copy=True),
                                    requires_grad=False)
                for name, p in module.named_parameters()}
        reference = copy.deepcopy(module, memo)
        reference.requires_grad_(False).eval()
        # A plain attribute (not a registered submodule) so it never enters state_dict / DDP.
        object.__setattr__(self, "_reference", reference)

    def attach_teacher(self, teacher: nn.Module) -> None:
        """Keep ``teacher``, a frozen denoiser of the same architecture (on-policy distillation's teacher,
        flowrl/rl/teacher.py), for :meth:`teacher`. A plain attribute, never a submodule: it is in no state dict,
        optimizer, checkpoint or EMA, and each process holds its own whole copy."""
        teacher.requires_grad_(False).eval()
        object.__setattr__(self, "_teacher", teacher)

    @property
    def has_teacher(self) -> bool:
        """Whether :meth:`attach_teacher` gave this model a teacher."""
        return self.__dict__.get("_teacher") is not None

    @contextlib.contextmanager
    def teacher(self) -> Iterator[None]:
        """Inside this context the adapter predicts with the teacher's denoiser (:meth:`attach_teacher`), with the
        student's encoders, conditioning and guidance: the teacher scores the states the student visited.

        Raises:
            RuntimeError: no teacher was attached.
        """
        teacher = self.__dict__.get("_teacher")
        if teacher is None:
            raise RuntimeError("this model has no teacher: call attach_teacher (train.teacher.path) first")
        with self._swapped_denoiser(teacher):
            yield

    def keep_float32_master_weights(self) -> None:
        """Full fine-tuning of a bfloat16 / float16 denoiser: keep its trained weights in float32 and compute in
        the 16-bit dtype under autocast, as diffusers' training scripts do (the trained model in float32, the
        frozen parts in the low precision, the forward under ``--mixed_precision``), and as LoRA weights are
        kept in float32 (:func:`flowrl.models.loading.upcast_trainable_`). AdamW stepping bfloat16 weights
        rounds away every update smaller than 1/256 of a weight (8 mantissa bits): a fine-tune at a typical
        learning rate would barely move.

        Only the parameters stored in 16 bits are upcast (diffusers keeps some modules in float32 on purpose, e.g.
        Wan's time embedder); the forward pass runs under ``torch.autocast(dtype=<the 16-bit dtype>)``, so matmuls
        keep their 16-bit speed. Costs 2 more bytes per trained parameter for the weights and for their
        gradients (the gradient follows the weight's dtype). A no-op for LoRA (its weights are float32 already)
        and for float32 models. Call it before the optimizer is built (ImageTraining does, for training only: the
        inference commands keep the loaded dtype).
        """
        if self.lora is not None or self._autocast_dtype is not None:
            return
        module = unwrap(self.denoiser)
        low = {name: p.dtype for name, p in module.named_parameters()
               if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)}
        if not low:
            return
        dtypes = set(low.values())
        if len(dtypes) > 1:
            raise ValueError(f"the denoiser mixes {sorted(map(str, dtypes))} weights; cannot pick one compute dtype")
        for name, p in module.named_parameters():
            if name in low:
                p.data = p.data.float()
        self._master_dtypes, self._autocast_dtype = low, dtypes.pop()

    def _master_autocast(self, x: torch.Tensor) -> contextlib.AbstractContextManager:
        """The 16-bit autocast of :meth:`keep_float32_master_weights` on ``x``'s device (a no-op otherwise)."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(x.device.type, dtype=self._autocast_dtype)


def _reshard(module: nn.Module) -> None:
    """Put FSDP2-sharded modules back in their sharded state. FSDP2 registers a module's whole (unsharded)
    parameters while they are gathered and leaves the root's gathered after a forward pass; the sharded
    parameters are the ones the optimizer steps, that gradients land on, and that an EMA must track.
    (Duck-typed: only ``flowrl/dist.py`` imports ``torch.distributed``.)"""
    for sub in module.modules():
        if type(sub).__name__.startswith("FSDP") and callable(getattr(sub, "reshard", None)):
            sub.reshard()


#: ``model.attention_backend`` values.
ATTENTION_BACKENDS = ("native", "xformers", "flash")


def _uses_attention_dispatcher(module: nn.Module) -> bool:
    """True when the module's attention processors go through diffusers' attention dispatcher (they carry an
    ``_attention_backend``), so ``set_attention_backend`` reaches them."""
    return any(hasattr(getattr(m, "processor", None), "_attention_backend") for m in module.modules())


def check_attention_backend(backend: str, device: torch.device | str) -> None:
    """Fail early, in one line, when ``backend`` cannot run on ``device`` (before any weights load).

    Raises:
        ConfigError: unknown backend, no CUDA device for xformers / flash, or the package is not installed.
    """
    import importlib.util

    from flowrl.config import ConfigError

    field = "model.attention_backend"
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(field, f"unknown backend {backend!r}; valid: {', '.join(ATTENTION_BACKENDS)}")
    if backend == "native":
        return
    kind = torch.device(device).type
    if kind != "cuda":
        what = "xformers has no CPU kernels" if backend == "xformers" else "flash-attn runs on CUDA GPUs only"
        raise ConfigError(field, f"{backend} needs a CUDA device and this model runs on {kind} ({what}); set "
                          f"model.attention_backend=native")
    if backend == "xformers" and importlib.util.find_spec("xformers") is None:
        raise ConfigError(field, "xformers is not installed; install the xformers wheel built for your torch (pip "
                          "install xformers --index-url https://download.pytorch.org/whl/<your CUDA, e.g. cu124>; "
                          "docs/distributed.md) or set model.attention_backend=native")
    if backend == "flash" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(field, "flash-attn is not installed (pip install flash-attn --no-build-isolation, built "
                          "against your torch); or set model.attention_backend=native")
