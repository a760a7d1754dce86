"""A transformers VLM or causal LM as a token policy: generation with per-token log-probs, re-scoring of
``[B, T]`` sequences with a loss mask, LoRA, the reference model and gradient checkpointing.

Log-probabilities are those of the *temperature-scaled* distribution ``softmax(logits / temperature)`` at
every position, in rollout and in training alike (as trl and verl compute them); top-p only truncates what
is sampled, it does not enter the log-probs.

Sampling is reproducible per sample: each row of a batch draws from its own ``torch.Generator`` seeded by
the caller (e.g. from ``(seed, epoch, global sample index, turn)``), so a sample's tokens do not depend on
which other samples share its batch or process.
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from flowrl.config import LoraConfig

from .families import Family, family_for_model_type
from .inputs import PolicyInputs, Turn, build_inputs

__all__ = ["TokenPolicy", "Generation", "PolicyLoadError"]


class PolicyLoadError(FlowrlError, RuntimeError):
    """A policy cannot be loaded (missing folder, missing weights, unsupported model); the message says the fix."""


@dataclass
class Generation:
    """One sampled continuation.

    Attributes:
        token_ids: the generated ids, ending with the end-of-turn token when the model emitted one (kept:
            the policy learns to stop), without padding.
        logprobs: ``[len(token_ids)]`` log-probs of those ids under ``softmax(logits / temperature)``.
        text: the decoded text without special tokens, cut before a stop string's end.
        finish: ``"stop"`` (end-of-turn token or stop string) or ``"length"`` (max tokens reached).
    """

    token_ids: list[int]
    logprobs: torch.Tensor
    text: str
    finish: str


_LM_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _RowSampler:
    """A logits processor that samples each row from its own generator (temperature, then top-p through
    transformers' own warper) and leaves only that token possible, so ``generate`` (run greedy) keeps it."""

    def __init__(self, generators: list[torch.Generator], temperature: float, top_p: float, greedy: bool,
                 banned: list[int] = ()):
        from transformers import TopPLogitsWarper

        self.generators, self.temperature, self.greedy = generators, temperature, greedy
        self.banned = list(banned)
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1.0 else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float()
        if self.banned:
            scores = scores.index_fill(1, torch.tensor(self.banned, device=scores.device), float("-inf"))
        if self.greedy:
            chosen = scores.argmax(dim=-1)
        else:
            logits = scores / self.temperature
            if self.top_p is not None:
                logits = self.top_p(input_ids, logits)
            probs = torch.softmax(logits, dim=-1).cpu()
            chosen = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0]
                                  for i, g in enumerate(self.generators)]).to(scores.device)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, chosen[:, None], 0.0)
        return out


class _StopStrings:
    """Stops a row once its decoded continuation contains a stop string. (transformers' StopStringCriteria
    builds a cleaned vocabulary by tokenizing a probe string, which fails for word-level tokenizers; decoding
    the few generated tokens works for any tokenizer.)"""

    def __init__(self, tokenizer, stop_strings, prompt_length: int):
        self.tokenizer, self.stop_strings, self.prompt_length = tokenizer, tuple(stop_strings), prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_length:], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stop_strings) for t in texts], device=input_ids.device)


class TokenPolicy:
    """A language or vision-language model seen as a policy over tokens.

    Build one with :meth:`from_pretrained` (any local folder or hub id of a supported family) or wrap an
    already built model and processor with the constructor.

    Args:
        model: a transformers model (``...ForConditionalGeneration`` or ``...ForCausalLM``), maybe peft-wrapped.
        processor: its processor (a tokenizer for text-only models).
        family: the :class:`Family`; default: from ``model.config.model_type``.
        reference: a frozen copy for the KL reference of a fully fine-tuned policy (None with LoRA: the
            reference is the same network with its adapters disabled).
    """

    def __init__(self, model, processor, family: Family | None = None, reference=None):
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        config = self.base_model.config
        self.family = family or family_for_model_type(config.model_type, self.tokenizer)
        self._reference = reference
        tok = self.tokenizer
        self.eos_text = self.family.ends["assistant"].split("\n")[0] or (tok.eos_token or "")
        eos_id = tok.convert_tokens_to_ids(self.eos_text) if self.eos_text else None
        if eos_id is None or eos_id == tok.unk_token_id:
            eos_id, self.eos_text = tok.eos_token_id, tok.eos_token or ""
        if eos_id is None:
            raise PolicyLoadError("the tokenizer has no end-of-turn or eos token; set tokenizer.eos_token")
        self.eos_token_id = int(eos_id)
        self.stop_token_ids = sorted({self.eos_token_id}
                                     | ({int(tok.eos_token_id)} if tok.eos_token_id is not None else set()))
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else self.eos_token_id)
        image_token = getattr(processor, "image_token", None)
        self.image_token_id = tok.convert_tokens_to_ids(image_token) if image_token and self.family.vision else None
        # Multimodal placeholder tokens are never sampled (and so never scored): an image token in an action
        # would have no image features behind it when the sequence is re-scored.
        banned = set()
        for token in getattr(tok, "all_special_tokens", []) + list(tok.get_added_vocab()):
            if any(word in token for word in ("image", "vision", "video", "<row_", "fake_token")):
                banned.add(int(tok.convert_tokens_to_ids(token)))
        self.banned_token_ids = sorted(banned)

    # ------------------------------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu", lora: LoraConfig | None = None,
                        gradient_checkpointing: bool = False, trust_remote_code: bool = False,
                        attn_implementation: str | None = None, inference: bool = False) -> "TokenPolicy":
        """Load a model and its processor from a local folder (or a hub id), offline-friendly.

        Args:
            path: folder with ``config.json``, weights and processor / tokenizer files.
            dtype: parameter dtype.
            device: where the model runs.
            lora: LoRA settings, or None for full fine-tuning (then a frozen copy is the reference).
            gradient_checkpointing: recompute activations in the backward pass (saves memory).
            trust_remote_code: off unless you trust the folder's code.
            attn_implementation: e.g. ``"sdpa"`` or ``"flash_attention_2"`` (None: transformers' default).
            inference: generate and score only (the demo, ``flowrl eval``): frozen weights and no reference
                copy (a full fine-tuning policy otherwise keeps a second copy of the model for its KL).

        Raises:
            PolicyLoadError: the folder is missing or incomplete, or the model is not a supported family.
        """
        from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor,
                                  AutoTokenizer)

        path = str(path)
        local = Path(path)
        if ((local.is_absolute() or path.startswith((".", "~")) or local.exists())
                and not (local / "config.json").is_file()):
            raise PolicyLoadError(f"no model at {path!r}: expected a folder with config.json, weights and the "
                                  "processor/tokenizer files (e.g. saved with save_pretrained)")
        from flowrl.untrusted import pickle_only_weights, safetensors_conversion

        pickles = pickle_only_weights(local)
        if pickles:  # transformers would unpickle them (which can run code); use_safetensors=True refuses them
            raise PolicyLoadError(f"{path!r} holds only pickled weights ({', '.join(pickles)}), which can run code "
                                  "when loaded; flowrl reads safetensors only: "
                                  f"{safetensors_conversion(local, 'transformers', 'AutoModel')}")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as err:
            raise PolicyLoadError(f"cannot read the model config of {path!r}: {err}; give a local folder with "
                                  "config.json (set HF_HUB_OFFLINE=1 to skip hub look-ups)") from None
        vision = getattr(config, "vision_config", None) is not None
        kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code, "use_safetensors": True}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        try:
            if vision:
                model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
                processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
            else:
                model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
                processor = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as err:
            raise PolicyLoadError(f"cannot load the model or processor of {path!r} ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''}); the folder needs weights "
                                  "(safetensors) and processor/tokenizer files") from None
        model.to(device)
        if inference:
            model.config.use_cache = False
            return cls(model.eval().requires_grad_(False), processor)
        return cls.prepare(model, processor, lora=lora, gradient_checkpointing=gradient_checkpointing)

    @classmethod
    def prepare(cls, model, processor, *, lora: LoraConfig | None = None,
                gradient_checkpointing: bool = False) -> "TokenPolicy":
        """Wrap a built model: add LoRA adapters (or keep a frozen reference copy), set checkpointing."""
        reference = None
        model.config.use_cache = False  # training forwards; generate() turns the cache on for itself
        if lora is not None:
            from peft import LoraConfig as PeftLoraConfig, get_peft_model

            targets = list(lora.target_modules) or language_model_projections(model)
            if not targets:
                raise PolicyLoadError("no LoRA target modules found; set model.lora.target_modules")
            model.requires_grad_(False)
            # peft's default initialisation (Kaiming-uniform down projections), as transformers' fine-tuning uses.
            model = get_peft_model(model, PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                         target_modules=targets))
        else:
            model.requires_grad_(True)
            reference = copy.deepcopy(model).eval().requires_grad_(False)
        if gradient_checkpointing:
            base = model.get_base_model() if lora is not None else model
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if lora is not None:
                base.enable_input_require_grads()
        return cls(model, processor, reference=reference)

    # ------------------------------------------------------------------------------------------ parts

    @property
    def is_lora(self) -> bool:
        return hasattr(self.model, "disable_adapter")

    @property
    def base_model(self):
        """The transformers model underneath any peft wrapper."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Only the trained tensors (LoRA adapters, or every weight), detached on the CPU."""
        names = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if n in names}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        missing = [n for n in state if n not in params]
        if missing:
            raise PolicyLoadError(f"checkpoint tensors {missing[:3]} do not exist in this model; was it trained "
                                  "with other model or LoRA settings?")
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))

    def train(self, mode: bool = True) -> "TokenPolicy":
        self.model.train(mode)
        return self

    def eval(self) -> "TokenPolicy":
        return self.train(False)

    def save_pretrained(self, path: str | Path) -> None:
        """A loadable folder: the model (LoRA merged into the weights) and its processor."""
        model = self.model
        if self.is_lora:
            model = copy.deepcopy(self.model).merge_and_unload()
        model.save_pretrained(path, safe_serialization=True)
        self.processor.save_pretrained(path)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Inside the block, :meth:`score` uses the reference policy (adapters off, or the frozen copy)."""
        if self.is_lora:
            with self.model.disable_adapter():
                yield
            return
        if self._reference is None:
            raise RuntimeError("this policy has no reference model (built without prepare())")
        self._scoring_model = self._reference
        try:
            yield
        finally:
            self._scoring_model = None

    _scoring_model = None

    # ------------------------------------------------------------------------------------------ inputs

    def build_inputs(self, conversations: list[list[Turn]], *, add_generation_prompt: bool = False) -> PolicyInputs:
        """See :func:`flowrl.policies.inputs.build_inputs`."""
        return build_inputs(self, conversations, add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------------------------------ scoring

    def score(self, inputs: PolicyInputs, *, temperature: float = 1.0, module=None,
              with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of the batch's own tokens: ``logp[b, t] = log softmax(logits[b, t-1] / T)[ids[b, t]]``.

        Only positions from the first trained token onward are computed (``logits_to_keep``), so long
        prompts cost no vocabulary-sized logits. Gradients flow unless called under ``torch.no_grad()``.

        Args:
            inputs: from :meth:`build_inputs`.
            temperature: the sampling temperature (log-probs of the tempered distribution).
            module: the module to run (e.g. the DDP-wrapped model in training); default: the policy's model,
                or the reference inside :meth:`reference`.

            with_entropy: also return the entropy of the tempered distribution at each trained position.

        Returns:
            ``[B, T]`` float32, 0 where ``inputs.loss_mask`` is 0; with ``with_entropy`` a pair
            ``(logp, entropy)`` of that shape (the entropy is detached: a diagnostic, not a loss term).
        """
        inputs = inputs.to(self.device)
        ids, mask = inputs.input_ids, inputs.loss_mask
        T = ids.shape[1]
        trained = mask.sum(0).nonzero()
        if trained.numel() == 0:
            zeros = torch.zeros(mask.shape, device=self.device)
            return (zeros, zeros.clone()) if with_entropy else zeros
        first = max(int(trained[0]), 1)
        keep = T - first + 1  # logits at positions first-1 .. T-1 predict tokens first .. T
        model = module if module is not None else (self._scoring_model or self.model)
        out = model(**inputs.tensors, logits_to_keep=keep, use_cache=False)
        logits = out.logits[:, -keep:-1].float() / temperature
        logits = _ban(logits, self.banned_token_ids)
        targets = ids[:, first:]
        log_probs = torch.log_softmax(logits, dim=-1)
        logp = log_probs.gather(-1, targets[..., None])[..., 0]
        head = torch.zeros(mask.shape[0], first, device=self.device, dtype=logp.dtype)
        full = torch.cat([head, logp], dim=1)
        full = torch.where(mask > 0, full, torch.zeros_like(full))
        if not with_entropy:
            return full
        with torch.no_grad():
            p = log_probs.exp()  # banned ids have p = 0 (and log p = -inf): they contribute nothing
            entropy = -(p * torch.where(p > 0, log_probs, torch.zeros_like(log_probs))).sum(-1)
            entropy = torch.cat([head.detach(), entropy], dim=1)
        return full, torch.where(mask > 0, entropy, torch.zeros_like(entropy))

    # ------------------------------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, conversations: list[list[Turn]], *, seeds: list[int], temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 32, stop_strings: tuple[str, ...] = (),
                 greedy: bool = False, batch_size: int = 32, share_prompts: bool = False) -> list[Generation]:
        """Sample the next assistant turn of each conversation.

        Args:
            conversations: ``B`` conversations (the next turn is the assistant's).
            seeds: ``B`` per-sample seeds (row ``i`` samples from ``torch.Generator().manual_seed(seeds[i])``).
            temperature: softmax temperature (> 0); log-probs are those of the tempered distribution.
            top_p: nucleus sampling mass (1 = off).
            max_new_tokens: the longest action; an action cut here has ``finish == "length"``.
            stop_strings: generation stops after any of these strings (it is kept in the text and ids).
            greedy: arg-max decoding (evaluation); ``seeds`` are then unused.
            batch_size: conversations per ``generate`` call.
            share_prompts: encode each distinct conversation of a call once (the vision tower and the prompt's
                forward), then copy its cache to every row asking it, as for the members of a GRPO group. The
                tokens and log-probs are those of the unshared path up to float rounding (tested); families
                without a shared-cache path here generate unshared.

        Returns:
            ``B`` :class:`Generation`.
        """
        if len(seeds) != len(conversations):
            raise ValueError(f"got {len(conversations)} conversations but {len(seeds)} seeds")
        if not greedy and not temperature > 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for arg-max); got {temperature}")
        out: list[Generation] = []
        for start in range(0, len(conversations), batch_size):
            chunk = conversations[start:start + batch_size]
            out += self._generate_chunk(chunk, seeds[start:start + batch_size], temperature, top_p, max_new_tokens,
                                        tuple(stop_strings), greedy, share_prompts)
        return out

    def _shared_prefix(self, conversations, inputs: PolicyInputs) -> dict | None:
        """The distinct conversations' prompt minus its last token run once, its cache copied to every row:
        ``{"cache": ..., "rows": distinct count}`` for :meth:`_generate_chunk`, or None when every row is distinct
        or the family has no shared-cache path (the rope offsets of Qwen2-VL-style M-RoPE are copied too)."""
        keys = [_conversation_key(c) for c in conversations]
        first: dict = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        if len(first) == len(keys) or inputs.input_ids.shape[1] < 2:
            return None
        inner = self.model.get_base_model() if self.is_lora else self.model
        if self.family.name not in _SHARED_PREFILL_FAMILIES:
            return None
        distinct = list(first.values())
        index = torch.tensor([distinct.index(first[k]) for k in keys], device=self.device)
        unique = self.build_inputs([conversations[i] for i in distinct], add_generation_prompt=True).to(self.device)
        if not torch.equal(unique.input_ids[index], inputs.input_ids):  # another padding: not worth special-casing
            return None
        prefix = {k: (v[:, :-1] if k in _PER_TOKEN_KEYS else v) for k, v in unique.tensors.items()}
        result = self.model(**prefix, use_cache=True)
        cache = getattr(result, "cache", None) or getattr(result, "past_key_values", None)
        if cache is None:
            return None
        cache.reorder_cache(index)  # row i continues from its distinct conversation's cache
        language = getattr(inner, "model", inner)
        if getattr(language, "rope_deltas", None) is not None:
            language.rope_deltas = language.rope_deltas[index]
        return {"cache": cache, "rows": len(distinct)}

    def _generate_chunk(self, conversations, seeds, temperature, top_p, max_new_tokens, stop_strings, greedy,
                        share_prompts=False):
        from transformers import GenerationConfig, LogitsProcessorList

        inputs = self.build_inputs(conversations, add_generation_prompt=True).to(self.device)
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=self.stop_token_ids,
                                  pad_token_id=self.pad_token_id, output_logits=True, return_dict_in_generate=True,
                                  use_cache=True)
        extra = {}
        if stop_strings:
            from transformers import StoppingCriteriaList

            extra["stopping_criteria"] = StoppingCriteriaList(
                [_StopStrings(self.tokenizer, stop_strings, inputs.input_ids.shape[1])])
        was_training = self.model.training
        self.model.eval()
        try:
            model_inputs = inputs.tensors
            shared = None
            if share_prompts:
                with torch.no_grad():
                    shared = self._shared_prefix(conversations, inputs)
            if shared is not None:  # images are in the cache: only the text ids, mask and cache go in
                model_inputs = {k: v for k, v in inputs.tensors.items() if k in _PER_TOKEN_KEYS}
                model_inputs["cache" if _CACHE_KWARG == "cache" else "past_key_values"] = shared["cache"]
            result = self.model.generate(**model_inputs, generation_config=config,
                                         logits_processor=LogitsProcessorList([_RowSampler(
                                             generators, temperature, top_p, greedy, self.banned_token_ids)]),
                                         **extra)
        finally:
            self.model.train(was_training)
        prompt_len = inputs.input_ids.shape[1]
        new = result.sequences[:, prompt_len:].cpu()
        if new.shape[1]:
            logits = torch.stack(result.logits, dim=1).float().cpu()  # [B, L, V] raw logits
            scale = 1.0 if greedy else temperature
            logps = torch.log_softmax(_ban(logits / scale, self.banned_token_ids),
                                      dim=-1).gather(-1, new[..., None])[..., 0]
        else:
            logps = torch.zeros(new.shape)
        return [self._finish(new[i].tolist(), logps[i], max_new_tokens, stop_strings) for i in range(new.shape[0])]

    def _finish(self, ids: list[int], logps: torch.Tensor, max_new_tokens: int, stop_strings) -> Generation:
        n, finish = len(ids), "length"
        for k, token in enumerate(ids):
            if token in self.stop_token_ids:
                n, finish = k + 1, "stop"
                break
        if stop_strings:
            # The first token after which the decoded text contains a stop string ends the action.
            full = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            if any(s in full for s in stop_strings):
                for k in range(1, n + 1):
                    if any(s in self.tokenizer.decode(ids[:k], skip_special_tokens=True) for s in stop_strings):
                        n, finish = k, "stop"
                        break
        if finish == "length" and n < max_new_tokens:
            finish = "stop"  # generate stopped early for this row (a stop criterion), not the length
        ids = ids[:n]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in stop_strings:
            if s in text:
                text = text[: text.index(s) + len(s)]
        return Generation(ids, logps[:n].clone(), text.strip(), finish)


# Families whose generate() continues from a copied prompt cache exactly (tests/policies: shared == unshared).
_SHARED_PREFILL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "causal_lm")
# Inputs with one entry per token (cut with the prompt's last token); the others (images) are per image.
_PER_TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
_CACHE_KWARG = "cache"  # transformers 5.x names generate()'s cache `cache` (past_key_values is deprecated)


def _conversation_key(conversation) -> tuple:
    """A hashable identity of a conversation: roles, texts and the images' bytes."""
    import hashlib

    import numpy as np

    parts = []
    for turn in conversation:
        digests = tuple(hashlib.sha1(np.ascontiguousarray(np.asarray(image)).tobytes()).hexdigest()
                        for image in (turn.images or ()))
        parts.append((turn.role, turn.text, digests, tuple(getattr(turn, "token_ids", None) or ())))
    return tuple(parts)


def _ban(logits: torch.Tensor, banned: list[int]) -> torch.Tensor:
    """``logits [..., V]`` with the banned ids at -inf (the distribution the policy samples from and is scored on)."""
    if not banned:
        return logits
    return logits.index_fill(-1, torch.tensor(banned, device=logits.device), float("-inf"))


def language_model_projections(model) -> list[str]:
    """Full names of the language model's attention and MLP projections (the vision tower is left out)."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if any(part in name for part in ("visual", "vision", "vision_tower", "multi_modal_projector", "connector",
                                         "merger")):
            continue
        if name.split(".")[-1] in _LM_PROJECTIONS:
            names.append(name)
    return names
