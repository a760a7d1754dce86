"""The one function that turns conversations into model inputs, for rollout and training alike.

A conversation is a list of :class:`Turn`. Prompt, observation and tool-result turns are *text* (with
images): they are rendered with the family's markup and run through the model's own processor, which
expands each image placeholder into exactly as many image tokens as the vision tower yields features.
Assistant turns that the policy generated keep their *token ids* verbatim (never decoded and re-encoded,
which could change them), and only those ids are trained: ``loss_mask`` is 1 on them and 0 on prompt,
tool-result and observation tokens.

Rollout calls :func:`build_inputs` with ``add_generation_prompt=True`` on the conversation so far;
training calls it on the whole conversation. Both produce the same prefix token for token, so the policy
re-scores exactly the tokens it sampled, in the context it sampled them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .families import ROLES, Family

__all__ = ["Turn", "PolicyInputs", "build_inputs", "to_pil"]


@dataclass
class Turn:
    """One turn of a conversation.

    Attributes:
        role: ``system``, ``user``, ``tool`` (an environment's answer to a tool call) or ``assistant``.
        text: the turn's text; images go where ``{image}`` appears in it, or before the text when it has
            no ``{image}`` (one image per placeholder).
        images: images of the turn (``[H, W, 3]`` uint8 arrays or PIL images).
        token_ids: assistant turns the policy generated: the sampled ids (including a final end-of-turn
            token when the policy emitted one). ``None``: the text is tokenized (e.g. a demonstration).
    """

    role: str
    text: str = ""
    images: list[Any] = field(default_factory=list)
    token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Turn.role must be one of {', '.join(ROLES)}; got {self.role!r}")


@dataclass
class PolicyInputs:
    """A left-padded batch of ``B`` conversations of (padded) length ``T``.

    Attributes:
        tensors: model keyword arguments (``input_ids [B, T]``, ``attention_mask [B, T]``, image tensors).
        loss_mask: ``[B, T]`` float, 1 on tokens the policy generated (trained), 0 elsewhere.
        turn_index: ``[B, T]`` long, the index of the assistant turn a trained token belongs to (0 for the
            first action), -1 elsewhere. Turn-level advantages are spread over tokens with it.
        num_image_tokens: ``[B]`` image tokens per sample (diagnostics and tests).
    """

    tensors: dict[str, torch.Tensor]
    loss_mask: torch.Tensor
    turn_index: torch.Tensor
    num_image_tokens: torch.Tensor

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tensors["input_ids"]

    def to(self, device: torch.device | str) -> "PolicyInputs":
        return PolicyInputs({k: v.to(device) for k, v in self.tensors.items()}, self.loss_mask.to(device),
                            self.turn_index.to(device), self.num_image_tokens)


def to_pil(image: Any):
    """A PIL RGB image from a PIL image or an ``[H, W, 3]`` uint8 array."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"an image must be [H, W, 3] (uint8) or a PIL image; got shape {array.shape}")
    return Image.fromarray(array.astype(np.uint8))


def _turn_text(family: Family, turn: Turn) -> tuple[str, list[Any]]:
    """The turn's content with one image marker per image."""
    text = turn.text
    if turn.images and not family.vision:
        raise ValueError(f"the {family.name} family takes no images, but a {turn.role} turn has "
                         f"{len(turn.images)}; use a vision-language model or drop the images")
    n_slots = text.count("{image}")
    if n_slots == 0:
        text = "{image}" * len(turn.images) + text
    elif n_slots != len(turn.images):
        raise ValueError(f"a {turn.role} turn has {n_slots} {{image}} placeholders but {len(turn.images)} images")
    return text.replace("{image}", family.image_marker), list(turn.images)


class _Builder:
    """Accumulates one conversation's chunks: text (with images) runs through the processor, ids are
    appended as they are."""

    def __init__(self, processor, tokenizer, family: Family):
        self.processor, self.tokenizer, self.family = processor, tokenizer, family
        self.ids: list[int] = []
        self.mask: list[float] = []
        self.turn: list[int] = []
        self.token_extra: dict[str, list[int]] = {k: [] for k in family.token_keys
                                                  if k not in ("input_ids", "attention_mask")}
        self.images: dict[str, list[torch.Tensor]] = {}
        self.pending_text = ""
        self.pending_images: list[Any] = []
        self.first = True

    def text(self, text: str, images: list[Any] = ()) -> None:
        self.pending_text += text
        self.pending_images += list(images)

    def flush(self) -> None:
        if not self.pending_text and not self.pending_images:
            return
        kwargs = {"add_special_tokens": self.first, "return_tensors": "pt"}
        if self.pending_images:
            images = [to_pil(im) for im in self.pending_images]
            out = self.processor(text=[self.pending_text], images=[images] if self.family.padded_images else images,
                                 **kwargs)
        elif self.processor is not None and self.family.vision:
            out = self.processor(text=[self.pending_text], **kwargs)
        else:
            out = self.tokenizer([self.pending_text], **kwargs)
        ids = out["input_ids"][0].tolist()
        self.ids += ids
        self.mask += [0.0] * len(ids)
        self.turn += [-1] * len(ids)
        for key in self.token_extra:
            values = out.get(key)
            self.token_extra[key] += values[0].tolist() if values is not None else [0] * len(ids)
        for key in self.family.image_keys:
            if key in out:
                self.images.setdefault(key, []).append(out[key])
        self.pending_text, self.pending_images, self.first = "", [], False

    def action(self, ids: list[int], turn: int) -> None:
        self.flush()
        self.ids += list(ids)
        self.mask += [1.0] * len(ids)
        self.turn += [turn] * len(ids)
        for key in self.token_extra:
            self.token_extra[key] += [0] * len(ids)
        self.first = False


def _image_tensors(family: Family, chunks: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    if not chunks:
        return {}
    if family.padded_images:  # [1, n, ...] per chunk -> [1, sum n, ...]
        return {k: torch.cat(v, dim=1) for k, v in chunks.items()}
    return {k: torch.cat(v, dim=0) for k, v in chunks.items()}


def build_inputs(policy, conversations: list[list[Turn]], *, add_generation_prompt: bool = False) -> PolicyInputs:
    """Model inputs for ``B`` conversations, left-padded to a common length.

    Args:
        policy: a :class:`flowrl.policies.TokenPolicy` (its processor, tokenizer and family are used).
        conversations: ``B`` lists of :class:`Turn`.
        add_generation_prompt: end each conversation with the assistant's turn header (rollout).

    Returns:
        :class:`PolicyInputs` on the CPU.

    Raises:
        ValueError: images given to a text-only family, or placeholders that do not match the images.
    """
    family, tokenizer = policy.family, policy.tokenizer
    eos_text = family.ends["assistant"]
    built = []
    for conversation in conversations:
        b = _Builder(policy.processor, tokenizer, family)
        action = 0
        for turn in conversation:
            if turn.role == "assistant":
                b.text(family.starts["assistant"])
                ids = turn.token_ids
                if ids is None:  # a demonstration: its text plus the end-of-turn token, trained
                    ids = tokenizer(turn.text, add_special_tokens=False)["input_ids"] + [policy.eos_token_id]
                b.action(ids, action)
                action += 1
                # The end-of-turn token is part of the action when the policy emitted it; the rest of the
                # closing text (e.g. a newline) is prompt. A truncated action gets the whole closing text.
                ended = bool(ids) and ids[-1] in policy.stop_token_ids
                b.text(eos_text[len(policy.eos_text):] if ended and eos_text.startswith(policy.eos_text) else eos_text)
            else:
                text, images = _turn_text(family, turn)
                b.text(family.starts[turn.role] + text + family.ends[turn.role], images)
        if add_generation_prompt:
            b.text(family.starts["assistant"])
        b.flush()
        built.append(b)
    T = max(len(b.ids) for b in built)
    B = len(built)
    pad = policy.pad_token_id
    input_ids = torch.full((B, T), pad, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T))
    turn_index = torch.full((B, T), -1, dtype=torch.long)
    extra = {k: torch.zeros((B, T), dtype=torch.long) for k in built[0].token_extra}
    n_image_tokens = torch.zeros(B, dtype=torch.long)
    image_token_id = policy.image_token_id
    for i, b in enumerate(built):
        n = len(b.ids)
        input_ids[i, T - n:] = torch.tensor(b.ids, dtype=torch.long)
        attention[i, T - n:] = 1
        loss_mask[i, T - n:] = torch.tensor(b.mask)
        turn_index[i, T - n:] = torch.tensor(b.turn, dtype=torch.long)
        for k, v in b.token_extra.items():
            extra[k][i, T - n:] = torch.tensor(v, dtype=torch.long)
        if image_token_id is not None:
            n_image_tokens[i] = int((input_ids[i, T - n:] == image_token_id).sum())
    tensors = {"input_ids": input_ids, "attention_mask": attention, **extra}
    tensors.update(family.collate_images([_image_tensors(family, b.images) for b in built]))
    return PolicyInputs(tensors, loss_mask, turn_index, n_image_tokens)
