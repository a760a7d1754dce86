"""``adversarial``: a discriminator on a frozen backbone, trained against reference images (Adv-GRPO;
GAN-RM in unpaired mode). See ``docs/rewards_adversarial.md``.

Model: a frozen backbone (:mod:`rewards.backbones`: DINOv2 or the shipped shapes encoder) gives a
global token ``g [B, D]`` and patch tokens ``p [B, P, D]``; one head ``D: R^D -> R`` (Linear D -> 512,
GELU, Linear 512 -> 1) scores any token.

Discriminator loss on a real batch (reference images) and a fake batch (generations), with ``S`` a random
subset of ``n = min(64, P)`` patch tokens per image (drawn without replacement)::

    L = hinge(D(g_real), D(g_fake)) + 0.3 * hinge(D(p_real[S]), D(p_fake[S]))
    hinge(a, b) = mean(relu(1 - a)) + mean(relu(1 + b))

minimised by Adam (betas 0.5, 0.999), lr 1e-4. Reward (the raw head output, no squashing)::

    r = 0.7 * D(g) + 0.3 * mean_{all P patches} D(p)

on the same tokens the head was trained on: :meth:`Backbone.forward` is the only path from images to
tokens, for real, fake and scored images alike. With ``clip_margin=c`` (IRRL's clipped-linear discriminator
reward) the reward is ``min(r, c)``: linear while the discriminator still tells the sample from the references,
flat once it is fooled past the margin, so the policy earns nothing by pushing further into the region the
discriminator calls real (where a head that lags the policy is easiest to exploit).

Departures from Adv-GRPO's code, with reasons: its hinge terms are halved (``0.5 (real + fake)``); flowrl
uses the sum as written in its formula (with Adam the factor only rescales the loss, not the step).
Its reward L2-normalises the tokens while its training does not, so the head scores features it never
saw; here both use the backbone's one normalisation. Its reward averages 64 random patches; here all
patches, so the reward is deterministic. It samples patch indices with replacement; here without.

Loop API (see :class:`AdversarialReward`): ``reward(images, prompts, metadata)`` scores;
``update(fake_images, prompts, metadata)`` takes ``d_steps`` discriminator steps against freshly drawn
references and returns metrics (``adv/d_acc_fresh``: the accuracy on the new fakes before any step on them,
the held-out view of whether the discriminator separates); ``measure(...)`` returns the same metrics without a
step (epochs on which the schedule keeps the discriminator frozen); ``state_dict()`` / ``load_state_dict()`` hold
the head, the optimizer and the generator of the draws (resume is exact); ``grad_sync`` averages the head's
gradients across processes. :class:`DiscriminatorSchedule` says which epochs train the discriminator and which the
generator; :func:`trainable_rewards` finds the rewards with an ``update`` inside a composed reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from flowrl.config import bounds, fail

from .adversarial_refs import ReferenceSource, load_references
from .backbones import Backbone, BackboneFeatures, load_backbone
from .base import Reward, RewardError, RewardOutput, to_image_tensor

__all__ = ["AdversarialReward", "DiscriminatorHead", "DiscriminatorSchedule", "hinge_loss", "discriminator_loss",
           "head_reward", "clipped_linear", "select_patches", "trainable_rewards"]

GradSync = Callable[[list[torch.Tensor]], None]


class DiscriminatorHead(nn.Module):
    """``[..., D] -> [...]``: Linear(D, hidden), GELU, Linear(hidden, 1)."""

    def __init__(self, dim: int, hidden: int = 512):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens).squeeze(-1)


def hinge_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """``mean(relu(1 - real)) + mean(relu(1 + fake))`` over all elements of each."""
    return F.relu(1.0 - real_logits).mean() + F.relu(1.0 + fake_logits).mean()


def select_patches(patches: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``patches [B, P, D]``, ``index [B, n]`` -> ``[B, n, D]``."""
    return torch.gather(patches, 1, index.unsqueeze(-1).expand(-1, -1, patches.shape[-1]))


def discriminator_loss(head: nn.Module, real: BackboneFeatures, fake: BackboneFeatures, real_index: torch.Tensor,
                       fake_index: torch.Tensor, patch_weight: float = 0.3) -> tuple[torch.Tensor, dict]:
    """The hinge loss of the module docstring.

    Args:
        head: the discriminator head.
        real, fake: tokens of the real and fake batches (``[B, D]`` and ``[B, P, D]`` each).
        real_index, fake_index: ``[B, n]`` patch indices of each batch's subset.
        patch_weight: weight of the patch term (0.3).

    Returns:
        The loss (scalar, differentiable in the head) and detached parts: ``global``, ``patch`` (the two
        hinge terms), ``real``/``fake`` (mean global logits) and ``acc`` (fraction of the batch on the
        right side of 0 by the global logit, real and fake counted equally).
    """
    real_global, fake_global = head(real.global_token), head(fake.global_token)  # [B]
    real_patch = head(select_patches(real.patch_tokens, real_index))  # [B, n]
    fake_patch = head(select_patches(fake.patch_tokens, fake_index))
    global_term = hinge_loss(real_global, fake_global)
    patch_term = hinge_loss(real_patch, fake_patch)
    loss = global_term + patch_weight * patch_term
    with torch.no_grad():
        acc = 0.5 * ((real_global > 0).float().mean() + (fake_global < 0).float().mean())
    parts = {"global": global_term.detach(), "patch": patch_term.detach(), "real": real_global.detach().mean(),
             "fake": fake_global.detach().mean(), "acc": acc}
    return loss, parts


def head_reward(head: nn.Module, features: BackboneFeatures, global_weight: float = 0.7,
                patch_weight: float = 0.3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``global_weight * D(g) + patch_weight * mean_p D(p)``: returns (reward, D(g), mean D(p)), each ``[B]``."""
    global_score = head(features.global_token)
    patch_score = head(features.patch_tokens).mean(-1)
    return global_weight * global_score + patch_weight * patch_score, global_score, patch_score


def clipped_linear(scores: torch.Tensor, margin: float) -> torch.Tensor:
    """IRRL's clipped-linear discriminator reward ``min(scores, margin)`` (``[B] -> [B]``): the gradient is the
    identity below the margin and zero above it, so fooling the discriminator past the margin earns nothing."""
    return scores.clamp(max=margin)


@dataclass
class DiscriminatorSchedule:
    """Which epochs train the discriminator and which the generator (a config section for the loop).

    Epoch ``e`` (from 0) is a discriminator epoch when ``e < warmup_epochs`` or ``(e - warmup_epochs) %
    period < d_epochs``: its samples update only the discriminator and no generator step is taken
    (Adv-GRPO: ``period=10, d_epochs=9``). The other epochs update the generator with the current
    discriminator's rewards and, when ``d_on_generator_epochs``, then the discriminator on the same samples
    (a GAN-style alternation every epoch: ``period=1, d_epochs=0, d_on_generator_epochs=true``).
    ``d_epochs=0`` with ``d_on_generator_epochs=false`` keeps the discriminator frozen.
    """

    period: int = field(default=10, metadata=bounds(ge=1))
    d_epochs: int = field(default=9, metadata=bounds(ge=0))
    d_on_generator_epochs: bool = False
    warmup_epochs: int = field(default=0, metadata=bounds(ge=0))

    def check(self) -> None:
        if self.d_epochs >= self.period:
            fail("d_epochs", f"{self.d_epochs} of every {self.period} epochs leaves none for the generator; use "
                 f"d_epochs < period")

    def trains_generator(self, epoch: int) -> bool:
        return epoch >= self.warmup_epochs and (epoch - self.warmup_epochs) % self.period >= self.d_epochs

    def trains_discriminator(self, epoch: int) -> bool:
        return not self.trains_generator(epoch) or self.d_on_generator_epochs


def trainable_rewards(reward: Any) -> list[Any]:
    """The rewards with ``update`` and ``state_dict`` inside a reward composed by ``rewards.compose``
    (weighted sums, transforms, gated), in a fixed order; the reward itself if it has them."""
    found: list[Any] = []

    def visit(obj: Any) -> None:
        if callable(getattr(obj, "update", None)) and callable(getattr(obj, "state_dict", None)):
            found.append(obj)
            return
        for _, inner, _ in getattr(obj, "terms", []):
            visit(inner)
        for name in ("reward", "alignment", "quality"):
            inner = getattr(obj, name, None)
            if isinstance(inner, Reward):
                visit(inner)

    visit(reward)
    return found


def _positive(value: Any, name: str, kind: type = int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
            kind is int and int(value) != value):
        raise RewardError(f"adversarial: {name} must be a positive {kind.__name__}, got {value!r}")


class AdversarialReward(Reward):
    """The adversarial reward and its discriminator (see the module docstring).

    Args:
        backbone: ``"shapes"`` (the shipped encoder) or ``"dinov2"``.
        backbone_path: DINOv2 folder (``config.json`` + ``model.safetensors``), or another shapes encoder.
        image_size: DINOv2 input side (default: the checkpoint's).
        references: ``"shapes"`` (rendered for each prompt), a folder of images or webdataset shards.
        pairing: ``"prompt"`` (a reference of the sample's prompt) or ``"unpaired"`` (any reference; GAN-RM).
        reference_split: the shapes split drawn from in unpaired mode.
        max_references: at most this many reference images are read.
        patch_samples: patch tokens per image in the loss (64).
        global_weight, patch_weight: reward weights (0.7, 0.3).
        clip_margin: IRRL's clipped-linear reward ``min(r, clip_margin)`` (None: the raw ``r``). On the hinge
            loss's scale 0 is the decision boundary and 1 the margin the head pushes references to.
        patch_loss_weight: weight of the patch hinge term (0.3).
        hidden: head width (512).
        lr, betas: Adam's (1e-4, (0.5, 0.999)).
        d_steps: discriminator steps per :meth:`update` (each with fresh references and patch subsets).
        seed: seeds the head's initialisation and the generator of every draw.
        head_path: optional initial head weights: a file holding ``state_dict()["head"]`` (safetensors, or
            torch with ``weights_only``), e.g. a discriminator trained in an earlier run.
        rank, world_size: this process's slice of a global batch (see :meth:`update`).
        grad_sync: callable averaging a list of gradient tensors in place across processes
            (``flowrl.dist.Dist.all_reduce_mean_``); None in one process.
        device: where backbone and head run.
        batch_size: images per scoring call.
    """

    name = "adversarial"
    differentiable = True

    def __init__(self, backbone: str = "shapes", backbone_path: str | None = None, image_size: int | None = None,
                 references: str = "shapes", pairing: str = "prompt", reference_split: str = "train",
                 max_references: int = 4096, patch_samples: int = 64, global_weight: float = 0.7,
                 patch_weight: float = 0.3, clip_margin: float | None = None, patch_loss_weight: float = 0.3,
                 hidden: int = 512, lr: float = 1e-4,
                 betas: Sequence[float] = (0.5, 0.999), d_steps: int = 1, seed: int = 0,
                 head_path: str | None = None, rank: int = 0, world_size: int = 1,
                 grad_sync: GradSync | None = None, device: str = "cpu", batch_size: int = 64):
        if pairing not in ("prompt", "unpaired"):
            raise RewardError(f"adversarial: pairing must be 'prompt' or 'unpaired', got {pairing!r}")
        for value, what in ((max_references, "max_references"), (patch_samples, "patch_samples"),
                            (hidden, "hidden"), (d_steps, "d_steps"), (batch_size, "batch_size")):
            _positive(value, what)
        _positive(lr, "lr", float)
        if clip_margin is not None and (isinstance(clip_margin, bool) or not isinstance(clip_margin, (int, float))
                                        or not -10 <= clip_margin <= 10):
            raise RewardError(f"adversarial: clip_margin must be a number in [-10, 10] (the head's logit scale) or "
                              f"null, got {clip_margin!r}")
        self.clip_margin = None if clip_margin is None else float(clip_margin)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise RewardError(f"adversarial: betas must be two numbers in [0, 1), got {betas!r}")
        self.backbone: Backbone = load_backbone(backbone, backbone_path, image_size=image_size, device=device)
        self.device = next(self.backbone.parameters()).device
        self.references: ReferenceSource = load_references(references, max_images=int(max_references),
                                                           split=reference_split)
        self.paired = pairing == "prompt"
        self.patch_samples = int(patch_samples)
        self.global_weight, self.patch_weight = float(global_weight), float(patch_weight)
        self.patch_loss_weight = float(patch_loss_weight)
        self.d_steps = int(d_steps)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.set_shard(rank, world_size)
        self.grad_sync = grad_sync
        # The head's initial weights depend on the seed only, not on the global RNG's state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.head = DiscriminatorHead(self.backbone.dim, int(hidden)).to(self.device)
        if head_path is not None:
            from ._loading import load_state_dict_file

            state = load_state_dict_file(head_path, self.name, "Pass head_path=<a head state_dict file>.")
            try:
                self.head.load_state_dict(state)
            except RuntimeError as err:
                raise RewardError(f"adversarial: head_path {head_path!r} does not fit a {self.backbone.dim}-wide "
                                  f"backbone with hidden={hidden} ({' '.join(str(err).split())[:200]})") from None
        self.optimizer = torch.optim.Adam(self.head.parameters(), lr=float(lr), betas=tuple(float(b) for b in betas))
        self.generator = torch.Generator().manual_seed(self.seed + 1)
        self.updates = 0

    def set_shard(self, rank: int, world_size: int) -> None:
        """This process holds samples ``[rank * B, (rank + 1) * B)`` of each global batch of ``world_size * B``."""
        if not (isinstance(rank, int) and isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
            raise RewardError(f"adversarial: need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
        self.rank, self.world_size = rank, world_size

    # --------------------------------------------------------------------------------------- scoring

    def features(self, images: torch.Tensor) -> BackboneFeatures:
        return self.backbone(images)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        context = torch.enable_grad() if images.requires_grad else torch.no_grad()
        with context:
            scores, global_score, patch_score = head_reward(self.head, self.features(images), self.global_weight,
                                                            self.patch_weight)
            details = {f"{self.name}/global": global_score.detach().float(),
                       f"{self.name}/patch": patch_score.detach().float()}
            if self.clip_margin is not None:
                details[f"{self.name}/clipped"] = (scores.detach() > self.clip_margin).float()
                scores = clipped_linear(scores, self.clip_margin)
        return RewardOutput(scores.float(), details)

    # --------------------------------------------------------------------------------------- training

    def _local(self, draw: torch.Tensor, batch: int) -> torch.Tensor:
        """The rows of a global draw ``[world_size * batch, ...]`` that belong to this process."""
        return draw[self.rank * batch:(self.rank + 1) * batch]

    def _draw_patches(self, batch: int, num_patches: int) -> torch.Tensor:
        n = min(self.patch_samples, num_patches)
        keys = torch.rand(self.world_size * batch, num_patches, generator=self.generator)
        return self._local(keys.argsort(dim=1)[:, :n], batch).to(self.device)  # n distinct patches per image

    def update(self, fake_images: Any, prompts: Sequence[str],
               metadata: Sequence[dict] | None = None) -> dict[str, float]:
        """``d_steps`` discriminator steps with ``fake_images`` as the fake batch.

        Each step draws a real batch (one reference per fake sample: of its prompt when paired) and the
        patch subsets from this reward's generator. Every process draws for the whole global batch of
        ``world_size * B`` samples and keeps its rows, so the draws, and with ``grad_sync`` averaging the
        gradients, the update equal one process's on the concatenated batch (every process must pass the
        same ``B``). Gradients are averaged before Adam's step; metrics are this process's.

        Args:
            fake_images: ``[B, 3, H, W]`` in [0, 1] (or PIL images): this process's generations.
            prompts: their ``B`` prompts.
            metadata: unused (the loop's signature).

        Returns:
            ``adv/d_loss``, ``adv/d_loss_global``, ``adv/d_loss_patch``, ``adv/d_real``, ``adv/d_fake`` (mean
            global logits), ``adv/d_acc``, ``adv/matched_frac`` (references of the sample's prompt),
            averaged over the steps, ``adv/d_acc_fresh`` (the accuracy of the first step, before the head has
            stepped on these fakes) and ``adv/d_updates`` (updates so far).
        """
        return self._steps(fake_images, prompts, self.d_steps)

    def measure(self, fake_images: Any, prompts: Sequence[str],
                metadata: Sequence[dict] | None = None) -> dict[str, float]:
        """The metrics of :meth:`update` on one fresh draw of references, without a step (the head, the
        optimizer and the update count are unchanged; the draws' generator advances, and is checkpointed)."""
        return self._steps(fake_images, prompts, 0)

    def _steps(self, fake_images: Any, prompts: Sequence[str], steps: int) -> dict[str, float]:
        """``steps`` discriminator steps (0: measure only); see :meth:`update`."""
        fake = to_image_tensor(fake_images)
        prompts = list(prompts)
        batch = fake.shape[0]
        if len(prompts) != batch:
            raise RewardError(f"adversarial: update got {batch} images but {len(prompts)} prompts")
        if batch == 0:
            raise RewardError("adversarial: update needs at least one fake image")
        if not torch.isfinite(fake).all():  # one NaN image would poison the head for good
            raise RewardError("adversarial: update got images with NaN or infinite pixels; pass only the finite "
                              "samples (the discriminator was not updated)")
        with torch.no_grad():  # the backbone is frozen: the fake tokens serve every step
            fake_features = self.features(fake)
        totals: dict[str, float] = {}
        fresh = math.nan
        rounds = max(steps, 1)
        self.head.train()
        for step in range(rounds):
            seeds = self._local(torch.randint(0, 2**62, (self.world_size * batch,), generator=self.generator), batch)
            real, matched = self.references.draw(prompts, seeds, self.paired, self.backbone.resize)
            real_index = self._draw_patches(batch, self.backbone.num_patches)
            fake_index = self._draw_patches(batch, self.backbone.num_patches)
            with torch.no_grad():
                real_features = self.features(real)
            with torch.set_grad_enabled(steps > 0):
                loss, parts = discriminator_loss(self.head, real_features, fake_features, real_index, fake_index,
                                                 self.patch_loss_weight)
            if step == 0:  # the head has not stepped on these fakes yet: a held-out accuracy
                fresh = float(parts["acc"])
            if steps > 0:
                self.optimizer.zero_grad(set_to_none=False)
                loss.backward()
                if self.grad_sync is not None:
                    self.grad_sync([p.grad for p in self.head.parameters()])
                self.optimizer.step()
            values = {"d_loss": float(loss.detach()), "d_loss_global": float(parts["global"]),
                      "d_loss_patch": float(parts["patch"]), "d_real": float(parts["real"]),
                      "d_fake": float(parts["fake"]), "d_acc": float(parts["acc"]),
                      "matched_frac": float(matched.float().mean())}
            for key, value in values.items():
                totals[key] = totals.get(key, 0.0) + value / rounds
        self.head.eval()
        self.updates += int(steps > 0)
        metrics = {f"adv/{key}": value for key, value in totals.items()}
        metrics["adv/d_acc_fresh"] = fresh
        metrics["adv/d_updates"] = float(self.updates)
        return metrics

    # --------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Head, optimizer, the draws' generator and the update count (tensors and plain data only, so it
        loads with ``torch.load(weights_only=True)``)."""
        return {"head": {k: v.detach().cpu().clone() for k, v in self.head.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                "updates": self.updates, "dim": self.backbone.dim, "backbone": self.backbone.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("dim") != self.backbone.dim or state.get("backbone") != self.backbone.name:
            raise RewardError(f"adversarial: the saved discriminator is for a {state.get('backbone')} backbone of "
                              f"width {state.get('dim')}, this reward uses {self.backbone.name} of width "
                              f"{self.backbone.dim}; resume with the same reward settings")
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.updates = int(state["updates"])

    def __repr__(self) -> str:
        return (f"AdversarialReward(backbone={self.backbone.name!r}, references={len(self.references)}, "
                f"pairing={'prompt' if self.paired else 'unpaired'}, updates={self.updates})")
