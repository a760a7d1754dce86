"""The reward-hacking panel of an online run, measured at every evaluation (``hack/*`` in ``metrics.jsonl``).

What a reward cannot see, the panel measures (the metrics are :func:`flowrl.eval.hacking.hacking_panel`'s; the
loop adds the images and the base model):

- drift from the base model: the evaluation images against the base model's images of the same prompts and
  initial noise (drawn once, by the reference weights: LoRA adapters off, or the frozen copy of a full
  fine-tune), ``hack/drift_pixel`` and, with a feature network, ``hack/drift_feature``;
- diversity within a prompt: ``eval.hacking.diversity_prompts`` eval prompts drawn with
  ``eval.hacking.diversity_seeds`` seeds each, ``hack/diversity``;
- for the shapes world: ``hack/extra_object_rate``, ``hack/extra_objects``, ``hack/bg_shift``,
  ``hack/bg_r/g/b``, ``hack/accuracy[/kind]`` (the gold, strict accuracy) and ``hack/lenient_accuracy``;
- ``hack/kl_to_base``: the KL between the policy's and the base model's transitions of the training rollout
  step, along the policy's ODE path of ``eval.hacking.kl_prompts`` eval prompts (measured even when the loss
  has no KL term; same units as ``train/kl_ref``: the per-step Gaussian KL, averaged over the stochastic steps);
  logged only when the rollout step is stochastic (an ODE rollout has no transition density, its KL would be 0
  whatever the weights);
- ``hack/fm_to_base``: the flow-matching distance between the policy and the base model on the policy's own
  samples, meaningful for every trainer: ``eval.hacking.fm_prompts`` eval prompts are sampled by the policy (ODE
  on the training schedule), each sample ``x0`` is noised at ``eval.hacking.fm_levels`` fixed noise levels
  ``t_k = (k + 1/2) / K`` with fixed noise, ``x_t = (1 - t) x0 + t eps``, and ``mean_d (v_policy - v_base)^2`` at
  ``(x_t, t)`` is averaged over levels and samples (velocity units squared; docs/algorithms.md, section 6, relates
  it to the KL);
- the held-out rewards of ``reward.heldout`` (never trained on): ``hack/heldout/<name>/mean`` (and
  ``/accuracy`` when the reward reports correctness, ``/std`` when it is an ensemble: its members' disagreement).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from flowrl.config import bounds, fail
from flowrl.models.base import encode_rows

__all__ = ["HackingConfig", "HackingPanel", "fm_to_base", "heldout_metrics", "kl_to_base", "with_reference"]


@dataclass
class HackingConfig:
    enabled: bool = True
    # auto: the shipped shapes encoder when the prompts are the shapes world's, none otherwise; "shapes";
    # "none" (pixel metrics only); or a local DINOv2 folder (config.json + model.safetensors).
    features: str = "auto"
    diversity_prompts: int = field(default=8, metadata=bounds(ge=0, le=256))  # 0: no diversity metric
    diversity_seeds: int = field(default=4, metadata=bounds(ge=2, le=64))
    kl_prompts: int = field(default=16, metadata=bounds(ge=0, le=1024))  # 0: no hack/kl_to_base
    fm_prompts: int = field(default=16, metadata=bounds(ge=0, le=1024))  # 0: no hack/fm_to_base
    fm_levels: int = field(default=5, metadata=bounds(ge=1, le=100))  # noise levels (k + 1/2) / fm_levels

    def check(self) -> None:
        if not self.features:
            fail("features", "empty; use auto, shapes, none or a local DINOv2 folder")


FeatureFn = Callable[[torch.Tensor], torch.Tensor]


def build_features(spec: str, prompts: list[str], device) -> FeatureFn | None:
    """The panel's feature network (images ``[B, 3, H, W]`` in [0, 1] -> ``[B, D]``) named by ``spec``."""
    from flowrl.eval.hacking import is_shapes_world, shapes_feature_fn

    if spec == "none" or (spec == "auto" and not is_shapes_world(prompts)):
        return None
    if spec in ("auto", "shapes"):
        return shapes_feature_fn(str(device))
    from rewards.backbones import load_backbone

    backbone = load_backbone("dinov2", spec, device=str(device))

    @torch.no_grad()
    def features(images: torch.Tensor) -> torch.Tensor:
        return backbone(images.to(next(backbone.parameters()).device)).global_token.float().cpu()

    return features


@torch.no_grad()
def kl_to_base(model, step, prompts: list[str], seeds: list[int], *, guidance: float | None,
               batch_size: int, metadata: list[dict] | None = None) -> torch.Tensor:
    """Per-sample KL of the rollout ``step`` between the policy and the base model along the policy's ODE path.

    At every step ``t`` whose transition is stochastic (``std > 0``), both velocities are evaluated at the
    policy's ODE state ``x_t`` and the step's Gaussian means compared: ``||mu - mu_ref||^2 / (2 std_t^2)``
    (averaged or summed over elements as the step's ``reduction``, like the training loss's KL).

    Args:
        model: the policy (a :class:`flowrl.models.base.FlowModel`); its ``reference()`` is the base.
        step: the training rollout's ``samplers.Step`` on its schedule (``step.sigmas``, ``T`` steps).
        prompts / seeds: ``B`` prompts and the seeds of their initial noise.

    Returns:
        ``[B]`` mean over the stochastic steps of the per-step KL (zeros when no step is stochastic).
    """
    from flowrl.core.losses import gaussian_kl
    from samplers import euler_step, initial_noise

    velocity = model.velocity_fn(guidance)
    sigmas, device = step.sigmas, model.device
    reduction = step.hyperparams.get("reduction", "mean")
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        cond = encode_rows(model, chunk, None if metadata is None else metadata[start:start + batch_size])
        x = initial_noise(model.latent_shape, torch.as_tensor(seeds[start:start + batch_size]), device=device)
        total, counted = torch.zeros(len(chunk), dtype=torch.float64), 0
        for t in range(len(sigmas) - 1):
            sigma = torch.full((len(chunk),), float(sigmas[t]), device=device)
            v = velocity(x.to(model.dtype), sigma, cond).float()
            policy = step(v, x.float(), t, x_next=x.float())
            if float(policy.std.max()) > 0:
                with model.reference():
                    v_ref = velocity(x.to(model.dtype), sigma, cond).float()
                ref = step(v_ref, x.float(), t, x_next=x.float())
                total += gaussian_kl(policy.mean, ref.mean, policy.std, reduction=reduction).double().cpu()
                counted += 1
            x = euler_step(v, x.float(), float(sigmas[t]), float(sigmas[t + 1])).x_next
        out.append((total / max(counted, 1)).float())
    return torch.cat(out) if out else torch.zeros(0)


# Stream tag of the noise that fm_to_base mixes into the policy's samples (independent of the sampling noise).
STREAM_FM = 0xF3B


def fm_levels(count: int) -> list[float]:
    """The noise levels of ``hack/fm_to_base``: the midpoints ``(k + 1/2) / count`` of ``count`` equal bins of
    ``[0, 1]`` (5 levels: 0.1, 0.3, 0.5, 0.7, 0.9)."""
    return [(k + 0.5) / count for k in range(count)]


@torch.no_grad()
def fm_to_base(model, sigmas: torch.Tensor, prompts: list[str], seeds: list[int], *, guidance: float | None,
               batch_size: int, levels: int = 5, metadata: list[dict] | None = None) -> torch.Tensor:
    """Per-sample flow-matching distance between the policy and the base model on the policy's own samples.

    Each prompt is sampled by the policy with the Euler ODE on ``sigmas`` from its seed's initial noise, giving
    ``x0``; at every level ``t_k`` of :func:`fm_levels` it is noised with noise fixed by ``(seed, k)``,
    ``x_t = (1 - t_k) x0 + t_k eps_k``, and both models' velocities are compared there::

        fm = mean_k mean_d (v_policy(x_t, t_k) - v_base(x_t, t_k))^2

    It is 0 exactly when the two velocity fields agree on the policy's noised samples, and it needs no
    stochastic step, so it means the same for an ODE trainer as for Flow-GRPO (docs/algorithms.md, section 6).

    Args:
        model: the policy (a :class:`flowrl.models.base.FlowModel`); its ``reference()`` is the base.
        sigmas: ``[T + 1]`` the schedule of the policy's samples (the training rollout's).
        prompts / seeds: ``B`` prompts and the seeds of their initial noise (and of the mixed-in noise).
        guidance: classifier-free guidance of both models' velocities (the rollout's).
        levels: ``K``, the number of noise levels.

    Returns:
        ``[B]`` float32, the mean over the levels of each sample's squared velocity gap.
    """
    from samplers import derive_seed, euler_step, initial_noise

    velocity = model.velocity_fn(guidance)
    device = model.device
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk, chunk_seeds = prompts[start:start + batch_size], seeds[start:start + batch_size]
        cond = encode_rows(model, chunk, None if metadata is None else metadata[start:start + batch_size])
        x = initial_noise(model.latent_shape, torch.as_tensor(chunk_seeds), device=device)
        for t in range(len(sigmas) - 1):
            sigma = torch.full((len(chunk),), float(sigmas[t]), device=device)
            v = velocity(x.to(model.dtype), sigma, cond).float()
            x = euler_step(v, x.float(), float(sigmas[t]), float(sigmas[t + 1])).x_next
        total = torch.zeros(len(chunk), dtype=torch.float64)
        for k, level in enumerate(fm_levels(levels)):
            eps = initial_noise(model.latent_shape, torch.tensor([derive_seed(s, STREAM_FM, k) for s in chunk_seeds]),
                                device=device)
            x_t = (1.0 - level) * x + level * eps
            sigma = torch.full((len(chunk),), level, device=device)
            v = velocity(x_t.to(model.dtype), sigma, cond).double()
            with model.reference():
                v_ref = velocity(x_t.to(model.dtype), sigma, cond).double()
            total += (v - v_ref).square().flatten(1).mean(dim=1).cpu()
        out.append((total / levels).float())
    return torch.cat(out) if out else torch.zeros(0)


def heldout_metrics(name: str, out) -> dict[str, float]:
    """One held-out reward's evaluation metrics from its :class:`~rewards.base.RewardOutput` on the eval images:
    ``hack/heldout/<name>/mean``; ``.../accuracy`` when it reports ``correct``; ``.../std`` when it reports its
    members' spread (a ``*/std`` detail, e.g. an ensemble of ``shapes_proxy`` models): their disagreement, which
    grows where the policy leaves the data the members agree on (a gold-free over-optimisation signal)."""
    metrics = {f"hack/heldout/{name}/mean": float(out.scores.float().mean())}
    if "correct" in out.details:
        metrics[f"hack/heldout/{name}/accuracy"] = float(out.details["correct"].float().mean())
    spread = [value for key, value in out.details.items() if key.endswith("/std")]
    if spread:
        metrics[f"hack/heldout/{name}/std"] = float(spread[0].float().mean())
    return metrics


class HackingPanel:
    """The ``hack/*`` metrics of one evaluation (see the module docstring).

    Args:
        cfg: the ``eval.hacking`` section.
        prompts / metadata: the full eval prompt set (every process sees the same).
        heldout: ``{name: reward}`` of ``reward.heldout``.
        kl_step: the training rollout's ``samplers.Step`` (None, or a deterministic ``ode`` step: no
            ``hack/kl_to_base``).
        kl_guidance: the rollout's guidance scale (also of ``hack/fm_to_base``).
        fm_sigmas: the schedule the policy samples on for ``hack/fm_to_base`` (default ``kl_step``'s; None and
            no ``kl_step``: no ``hack/fm_to_base``).
        steps / guidance / batch_size: the evaluation's ODE sampling.
        dist: the run's :class:`flowrl.dist.Dist`.
    """

    def __init__(self, cfg: HackingConfig, prompts: list[str], metadata: list[dict], *, heldout: dict,
                 kl_step=None, kl_guidance: float | None = None, fm_sigmas: torch.Tensor | None = None, steps: int,
                 guidance: float | None, batch_size: int, dist):
        self.cfg, self.prompts, self.metadata, self.heldout = cfg, prompts, metadata, heldout
        self.kl_step, self.kl_guidance = kl_step, kl_guidance
        self.fm_sigmas = fm_sigmas if fm_sigmas is not None or kl_step is None else kl_step.sigmas
        self.steps, self.guidance, self.batch_size, self.dist = steps, guidance, batch_size, dist
        self._features: FeatureFn | None | bool = False  # built at first use (False: not yet)
        self._base: torch.Tensor | None = None  # uint8 [n, 3, H, W]: the base model's eval images, all rows

    def features(self) -> FeatureFn | None:
        if self._features is False:
            self._features = build_features(self.cfg.features, self.prompts, self.dist.device)
        return self._features

    def base_images(self, model, epoch: int, images: torch.Tensor, seeds: list[int],
                    should_stop=None) -> torch.Tensor:
        """The base model's images of every eval row (``images`` themselves at the evaluation before training;
        once drawn, later calls return them whatever the arguments)."""
        if self._base is None:
            base = images if epoch == 0 else with_reference(
                model, lambda: self._generate(model, self.prompts, seeds, should_stop, self.metadata))
            self._base = to_uint8(base)
        return self._base.float() / 255

    def _generate(self, model, prompts: list[str], seeds: list[int], should_stop=None,
                  metadata: list[dict] | None = None) -> torch.Tensor:
        """ODE samples of ``prompts`` (with their prompt-set rows, which an editing model reads) split over the
        processes, gathered (every process gets all)."""
        from flowrl.eval.generate import generate

        dist = self.dist
        n = len(prompts)
        rows, real = dist.even_shard(n)  # the same forwards on every process (FSDP2)
        local = generate(model, [prompts[i] for i in rows], [seeds[i] for i in rows], steps=self.steps,
                         guidance=self.guidance, batch_size=self.batch_size, should_stop=should_stop,
                         metadata=None if metadata is None else [metadata[i] for i in rows]) if rows else None
        return gather_images(dist, local[:real] if real else None, n, len(rows))

    def __call__(self, model, epoch: int, images: torch.Tensor, seeds: list[int], should_stop=None) -> dict[str, float]:
        """The panel for ``images`` (``[n, 3, H, W]`` in [0, 1]: every eval row, gathered, in order) drawn by
        ``model`` (its evaluated weights swapped in) at the eval ``seeds``."""
        from flowrl.eval.hacking import hacking_panel
        from rewards.base import checked_reward

        images = to_uint8(images).float() / 255  # 8-bit, as stored for the base (and as a saved image would be)
        features = self.features()
        base = self.base_images(model, epoch, images, seeds, should_stop)
        metrics = hacking_panel(images, self.prompts, base_images=base, features=features)
        if self.cfg.diversity_prompts and features is not None:
            k = min(self.cfg.diversity_prompts, len(self.prompts))
            prompts = [p for p in self.prompts[:k] for _ in range(self.cfg.diversity_seeds)]
            group_seeds = [1_000_003 * (i + 1) + j for i in range(k) for j in range(self.cfg.diversity_seeds)]
            group_rows = [m for m in self.metadata[:k] for _ in range(self.cfg.diversity_seeds)]
            group_images = self._generate(model, prompts, group_seeds, should_stop, group_rows)
            metrics["hack/diversity"] = hacking_panel(group_images, prompts, features=features,
                                                      shapes=False)["hack/diversity"]
        else:
            metrics.pop("hack/diversity", None)  # eval prompts are one seed each: no groups to measure
        for name, reward in self.heldout.items():
            metrics.update(heldout_metrics(name, checked_reward(reward, images, self.prompts, self.metadata)))
        # The KL of a deterministic (ode) step is 0 whatever the weights: not logged rather than a meaningless 0.
        if self.kl_step is not None and self.kl_step.stochastic and self.cfg.kl_prompts:
            metrics["hack/kl_to_base"] = self._spread(
                self.cfg.kl_prompts, seeds, lambda prompts, row_seeds, rows: kl_to_base(
                    model, self.kl_step, prompts, row_seeds, guidance=self.kl_guidance, batch_size=self.batch_size,
                    metadata=rows))
        if self.fm_sigmas is not None and self.cfg.fm_prompts:
            metrics["hack/fm_to_base"] = self._spread(
                self.cfg.fm_prompts, seeds, lambda prompts, row_seeds, rows: fm_to_base(
                    model, self.fm_sigmas, prompts, row_seeds, guidance=self.kl_guidance, batch_size=self.batch_size,
                    levels=self.cfg.fm_levels, metadata=rows))
        return metrics

    def _spread(self, count: int, seeds: list[int],
                measure: Callable[[list[str], list[int], list[dict]], torch.Tensor]) -> float:
        """The mean of ``measure(prompts, seeds, metadata) -> [b]`` over the first ``count`` eval prompts, split over
        the processes and gathered."""
        k = min(count, len(self.prompts))
        rows, real = self.dist.even_shard(k)  # the same forwards on every process (FSDP2); padding dropped
        values = measure([self.prompts[i] for i in rows], [seeds[i] for i in rows], [self.metadata[i] for i in rows])
        keep = self.dist.gather(torch.cat([torch.ones(real), torch.zeros(len(rows) - real)])) > 0
        return float(self.dist.gather(values.float().cpu())[keep].mean())


def with_reference(model, draw: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``draw()`` with the model's reference (base) weights, in eval mode; the model's mode is restored."""
    was_training = model.training
    model.eval()
    try:
        with model.reference():
            return draw()
    finally:
        model.train(was_training)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    return (images.clamp(0, 1) * 255).round().to(torch.uint8)


def gather_images(dist, local: torch.Tensor | None, n: int, per: int) -> torch.Tensor:
    """Every process's ``local`` images (``per`` rows each at most, ``n`` in all) on every process, in row
    order; sent as uint8 (a quarter of the bytes; the panel's metrics are in 0-255 units anyway)."""
    if dist.world_size == 1:
        return local
    shape = local.shape[1:] if local is not None else None
    shape = next(s for s in dist.gather_object([shape]) if s is not None)  # a process may hold no rows
    rows = torch.zeros((per, *shape), dtype=torch.uint8)
    if local is not None:
        rows[: local.shape[0]] = to_uint8(local)
    gathered = dist.gather(rows.to(dist.device)).cpu()
    return gathered[:n].float() / 255
