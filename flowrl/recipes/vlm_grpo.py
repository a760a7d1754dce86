"""GRPO and its family for VLM / LM agents: GRPO, Dr.GRPO, DAPO, RLOO and GSPO, single- or multi-turn.

Papers: Shao et al. 2024 (DeepSeekMath, GRPO); Liu et al. 2025 ("Understanding R1-Zero-Like Training",
Dr.GRPO); Yu et al. 2025 (DAPO); Ahmadian et al. 2024 (RLOO for LLMs); Zheng et al. 2025 (GSPO); Feng et al.
2025 (GiGPO) for turn-level credit. One epoch:

1. ``groups_per_epoch`` tasks are drawn (a pure function of ``(seed, epoch, round)``), each played
   ``group_size`` times; each process plays a contiguous shard of the episodes with the policy
   (:func:`flowrl.envs.rollout.play_episodes`; per-sample seeds, so the samples do not depend on the
   number of processes), then every process gathers every episode.
2. Rewards: the answer rewards (exact match, numeric, format, ``vlm_judge``) of each episode's final answer
   plus the environment's per-turn rewards (e.g. -0.05 per tool call), plus DAPO's overlong penalty. DAPO's
   dynamic sampling drops groups whose rewards are all equal and plays more rounds until the epoch has
   ``groups_per_epoch`` informative groups (at most ``max_sampling_rounds``).
3. Advantages on the whole epoch (``flowrl.core``): group (GRPO, DAPO, GSPO), group without std (Dr.GRPO),
   or leave-one-out (RLOO) per episode; or per turn with GiGPO / discounted turn returns. Each token of an
   action gets its turn's advantage.
4. Old log-probs (and the reference's, when KL is on) are re-scored with the same inputs and the same
   micro-batches training will use, so the ratio is exactly 1 before the first update. Then for each inner
   epoch and minibatch: clipped policy loss (token ratio; GSPO: sequence ratio ``exp(mean_t log ratio)``),
   plus ``beta * k3`` KL to the reference (LoRA adapters off, or a frozen copy), accumulated over
   micro-batches, one optimizer step per minibatch.

Choices and departures (docs/vlm.md has the formulas):
- the loss is normalised by *global* counts (tokens, sequences, or sequences x the token budget for
  Dr.GRPO's ``seq_mean_token_sum_norm``) of the minibatch, so one process with accumulation ``2a`` and two
  processes with accumulation ``a`` take the same step;
- log-probs are those of ``softmax(logits / temperature)``; top-p only shapes sampling;
- the rollout's own log-probs are kept for diagnostics (``train/rollout_logp_gap``), not used as the old
  policy: a generation kernel (KV cache) rounds differently from a full forward pass;
- a malformed tool call, an empty answer or a cut-off action is counted and scored as what it is, never an
  error.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from tqdm.auto import tqdm

from flowrl.config import RunConfig, bounds, fail, save_config
from flowrl.recipes import Recipe

__all__ = ["Config", "main", "RECIPE", "VARIANTS", "Variant", "EpochBatch", "collect_epoch", "compute_advantages",
           "train_epoch", "build_policy"]


# ============================================================================ variants


@dataclass(frozen=True)
class Variant:
    """The defaults one algorithm sets; a config value that is not null overrides them."""

    estimator: Literal["group", "rloo"] = "group"
    std_scope: Literal["group", "batch", "none"] = "group"
    aggregation: str = "seq_mean_token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    ratio: Literal["token", "sequence"] = "token"
    dynamic_sampling: bool = False
    overlong_penalty: bool = False


VARIANTS: dict[str, Variant] = {
    # DeepSeekMath: group mean / std, per-sequence token means, symmetric clip.
    "grpo": Variant(),
    # Dr.GRPO: no std division, no per-sequence length normalisation (sum / (B * token budget)).
    "dr_grpo": Variant(std_scope="none", aggregation="seq_mean_token_sum_norm"),
    # DAPO: clip-higher, token-level mean, dynamic sampling, soft overlong penalty.
    "dapo": Variant(aggregation="token_mean", clip_high=0.28, dynamic_sampling=True, overlong_penalty=True),
    # RLOO: leave-one-out baseline, no std.
    "rloo": Variant(estimator="rloo", std_scope="none", aggregation="seq_mean_token_mean"),
    # GSPO: sequence-level ratio exp(mean_t log ratio), clipped to a very narrow range.
    "gspo": Variant(ratio="sequence", clip_low=3e-4, clip_high=4e-4),
}


# ============================================================================ config


@dataclass
class LoraConfig:
    rank: int = field(default=16, metadata=bounds(ge=1))
    alpha: float = field(default=32.0, metadata=bounds(gt=0))
    dropout: float = field(default=0.0, metadata=bounds(ge=0, lt=1))
    target_modules: list[str] = field(default_factory=list)


@dataclass
class ModelConfig:
    path: str | None = None  # a local model folder or hub id; None: the shipped Shapes-VQA model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig | None = None  # None: full fine-tuning (a frozen copy is the KL reference)
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None


@dataclass
class EnvConfig:
    name: Literal["shapes_vqa", "shapes_zoom"] = "shapes_vqa"
    kinds: list[str] | None = None  # None: every kind of the environment
    max_turns: int | None = field(default=None, metadata=bounds(ge=1))  # None: the environment's default
    system_prompt: str | None = None  # a system turn before the first observation (e.g. an answer format)


@dataclass
class SamplingConfig:
    group_size: int = field(default=8, metadata=bounds(ge=2))
    groups_per_epoch: int = field(default=16, metadata=bounds(ge=1))
    temperature: float = field(default=1.0, metadata=bounds(gt=0))
    top_p: float = field(default=1.0, metadata=bounds(gt=0, le=1))
    max_new_tokens: int = field(default=16, metadata=bounds(ge=1, le=32768))
    stop_strings: list[str] = field(default_factory=list)
    batch_size: int = field(default=64, metadata=bounds(ge=1))  # episodes per generate call, per process
    max_sampling_rounds: int = field(default=4, metadata=bounds(ge=1))  # DAPO dynamic sampling


@dataclass
class AlgorithmConfig:
    variant: str = "grpo"  # grpo | dr_grpo | dapo | rloo | gspo
    # null: the variant's default (see VARIANTS)
    estimator: Literal["group", "rloo"] | None = None
    std_scope: Literal["group", "batch", "none"] | None = None
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                         "seq_mean_token_sum_norm"] | None = None
    clip_low: float | None = field(default=None, metadata=bounds(ge=0, lt=1))
    clip_high: float | None = field(default=None, metadata=bounds(ge=0))
    dynamic_sampling: bool | None = None
    overlong_penalty: bool | None = None
    overlong_cache: int | None = field(default=None, metadata=bounds(ge=1))  # None: a quarter of the budget
    eps: float = field(default=1e-4, metadata=bounds(gt=0))
    adv_clip: float = field(default=5.0, metadata=bounds(gt=0))
    # Turn-level credit: outcome (every token gets its episode's advantage), gigpo, turn_return.
    turn_credit: Literal["outcome", "gigpo", "turn_return"] = "outcome"
    gamma: float = field(default=0.95, metadata=bounds(ge=0, le=1))
    step_weight: float = field(default=1.0, metadata=bounds(ge=0))
    kl: Literal["none", "k3"] = "none"
    kl_beta: float = field(default=0.0, metadata=bounds(ge=0))

    def resolved(self) -> Variant:
        base = VARIANTS[self.variant]
        return Variant(**{name: getattr(self, name) if getattr(self, name) is not None else getattr(base, name)
                          for name in Variant.__dataclass_fields__ if hasattr(self, name)},
                       ratio=base.ratio)


@dataclass
class TrainConfig:
    inner_epochs: int = field(default=1, metadata=bounds(ge=1))
    minibatches: int = field(default=1, metadata=bounds(ge=1))  # optimizer steps per inner epoch
    micro_batch_size: int = field(default=32, metadata=bounds(ge=1))  # episodes per backward, per process


@dataclass
class OptimConfig:
    lr: float = field(default=1e-5, metadata=bounds(gt=0))
    weight_decay: float = field(default=0.0, metadata=bounds(ge=0))
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_epochs: int = field(default=0, metadata=bounds(ge=0))
    grad_clip: float = field(default=1.0, metadata=bounds(gt=0))


@dataclass
class RewardConfig:
    # name -> weight, or name -> {weight, kwargs} (flowrl/envs/rewards.py: exact, numeric, format, vlm_judge)
    answer: dict[str, Any] = field(default_factory=lambda: {"exact": 1.0})


@dataclass
class EvalConfig:
    every_epochs: int | None = field(default=None, metadata=bounds(ge=1))
    every_minutes: float | None = field(default=10.0, metadata=bounds(gt=0))
    at_start: bool = True
    num_examples: int = field(default=500, metadata=bounds(ge=1))
    batch_size: int = field(default=100, metadata=bounds(ge=1))


@dataclass
class LogConfig:
    backends: list[str] = field(default_factory=list)
    project: str = "flowrl"


@dataclass
class CheckpointConfig:
    every_epochs: int = field(default=20, metadata=bounds(ge=1))
    keep: int = field(default=2, metadata=bounds(ge=1))


@dataclass
class Config:
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/vlm_grpo", max_epochs=100))
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    RENAMED: ClassVar[dict[str, str]] = {"threads": "run.threads", "clock": "run.clock"}

    def check(self) -> None:
        a = self.algorithm
        if a.variant not in VARIANTS:
            fail("algorithm.variant", f"got {a.variant!r}, expected one of {', '.join(VARIANTS)}")
        v = a.resolved()
        if v.ratio == "sequence" and a.turn_credit != "outcome":
            fail("algorithm.turn_credit", "gspo's sequence-level ratio needs one advantage per episode; use "
                 "turn_credit: outcome")
        if a.kl != "none" and a.kl_beta == 0:
            fail("algorithm.kl_beta", f"kl is {a.kl!r} but kl_beta is 0; set kl_beta > 0 or kl: none")
        if not self.reward.answer:
            fail("reward.answer", "name at least one answer reward, e.g. {exact: 1.0}")
        from flowrl.envs.rewards import ANSWER_REWARDS

        for name in self.reward.answer:
            if name not in ANSWER_REWARDS:
                fail("reward.answer", f"unknown answer reward {name!r}; valid: {', '.join(ANSWER_REWARDS.names())}")
        if self.env.kinds is not None:
            from flowrl.envs.registry import get_env

            valid = get_env(self.env.name).kinds
            bad = [k for k in self.env.kinds if k not in valid]
            if bad:
                fail("env.kinds", f"{bad[0]!r} is not a task kind of {self.env.name}; valid: {', '.join(valid)}")
        if self.train.minibatches > self.sampling.groups_per_epoch * self.sampling.group_size:
            fail("train.minibatches", "more minibatches than episodes per epoch")


# ============================================================================ components


def build_policy(cfg: ModelConfig, device: torch.device):
    """The policy named by ``cfg`` (LoRA or full fine-tuning)."""
    from flowrl.policies import LoraSpec, TokenPolicy
    from flowrl.policies.shapes_vlm import resolve_model_path

    lora = None
    if cfg.lora is not None:
        lora = LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                        target_modules=tuple(cfg.lora.target_modules))
    return TokenPolicy.from_pretrained(resolve_model_path(cfg.path), dtype=cfg.dtype, device=device, lora=lora,
                                       gradient_checkpointing=cfg.gradient_checkpointing,
                                       attn_implementation=cfg.attn_implementation)


def _seed(*parts: int) -> int:
    from flowrl.envs.rollout import sample_seed

    return sample_seed(*parts)


# ============================================================================ one epoch


@dataclass
class EpochBatch:
    """The epoch's episodes (every process holds all of them) and their rewards.

    Attributes:
        episodes: ``N`` :class:`flowrl.envs.rollout.Episode`, groups contiguous.
        group_ids: ``[N]`` group of each episode.
        rewards: ``[N]`` episode reward (answer rewards + environment rewards + overlong penalty).
        turn_rewards: ``[N, K]`` per-turn rewards (the answer reward and overlong penalty on the last turn).
        turn_mask: ``[N, K]`` bool.
        details: ``{name: [N]}`` reward components.
        stats: sampling statistics for logging.
    """

    episodes: list
    group_ids: torch.Tensor
    rewards: torch.Tensor
    turn_rewards: torch.Tensor
    turn_mask: torch.Tensor
    details: dict[str, torch.Tensor]
    stats: dict[str, float]


def _score_episodes(episodes: list, answer_rewards, cfg: Config, variant: Variant):
    """Episode rewards, per-turn rewards and components."""
    scores, details = answer_rewards([e.answer for e in episodes], [e.task for e in episodes],
                                     [e.image for e in episodes])
    answered = torch.tensor([float(e.answered) for e in episodes])
    scores = scores * answered  # an episode that hit the turn limit answered nothing
    details = {k: v * answered for k, v in details.items()}
    K = max(e.num_turns for e in episodes)
    turn_rewards = torch.zeros(len(episodes), K)
    turn_mask = torch.zeros(len(episodes), K, dtype=torch.bool)
    overlong = torch.zeros(len(episodes))
    if variant.overlong_penalty:
        # DAPO's soft overlong punishment on the episode's generated tokens, against the whole budget.
        budget = cfg.sampling.max_new_tokens
        cache = cfg.algorithm.overlong_cache or max(budget // 4, 1)
        for i, e in enumerate(episodes):
            length = max(e.action_lengths)
            if length > budget - cache:
                overlong[i] = max(-1.0, ((budget - cache) - length) / cache)
        details["overlong_penalty"] = overlong
    for i, e in enumerate(episodes):
        n = e.num_turns
        turn_rewards[i, :n] = torch.tensor(e.turn_rewards)
        turn_rewards[i, n - 1] += scores[i] + overlong[i]
        turn_mask[i, :n] = True
    rewards = (turn_rewards * turn_mask).sum(1)
    return rewards, turn_rewards, turn_mask, details


def collect_epoch(policy, cfg: Config, epoch: int, dist, answer_rewards, env_spec, *, progress=None) -> EpochBatch:
    """Play the epoch's episodes (sharded over processes, gathered), score them, and (DAPO) refill groups whose
    rewards are all equal until ``groups_per_epoch`` informative groups are found."""
    from flowrl.envs.rollout import SamplingSettings, play_episodes

    variant = cfg.algorithm.resolved()
    s = cfg.sampling
    kinds = tuple(cfg.env.kinds or env_spec.kinds)
    settings = SamplingSettings(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                stop_strings=tuple(s.stop_strings), batch_size=s.batch_size)
    max_turns = cfg.env.max_turns or env_spec.max_turns
    kept: list[list] = []
    rounds, seen_groups, zero_std_groups = 0, 0, 0
    stats = {"truncated": 0.0, "empty": 0.0, "malformed": 0.0, "tool_call": 0.0, "turn_limit": 0.0, "episodes": 0.0}
    rounds_allowed = s.max_sampling_rounds if variant.dynamic_sampling else 1
    all_played = []
    while rounds < rounds_allowed and len(kept) < s.groups_per_epoch:
        round_seed = _seed(cfg.run.seed, epoch, rounds)
        tasks = env_spec.train_tasks("train", s.groups_per_epoch, seed=round_seed % (2**31), kinds=kinds)
        flat = [t for t in tasks for _ in range(s.group_size)]
        n = len(flat)
        per = math.ceil(n / dist.world_size)
        lo, hi = dist.rank * per, min((dist.rank + 1) * per, n)
        mine = play_episodes(policy, env_spec.make, flat[lo:hi], list(range(lo, hi)), seed=round_seed,
                             sampling=settings, max_turns=max_turns, system_prompt=cfg.env.system_prompt)
        if progress is not None:
            progress(len(mine))
        episodes = dist.gather_object(mine) if dist.world_size > 1 else mine
        groups = [episodes[g * s.group_size:(g + 1) * s.group_size] for g in range(s.groups_per_epoch)]
        seen_groups += len(groups)
        if variant.dynamic_sampling:  # keep only groups whose rewards differ (scored here to decide)
            rewards = _score_episodes(episodes, answer_rewards, cfg, variant)[0]
            for g, group in enumerate(groups):
                r = rewards[g * s.group_size:(g + 1) * s.group_size]
                if bool(r.max() == r.min()):
                    zero_std_groups += 1
                elif len(kept) < s.groups_per_epoch:
                    kept.append(group)
        else:
            kept = groups
        all_played += episodes
        rounds += 1
    if not kept:  # every group was constant in every round: train on the first round (zero advantages)
        kept = [all_played[g * s.group_size:(g + 1) * s.group_size] for g in range(s.groups_per_epoch)]
    # Every process trains on an equal shard: keep a multiple of the world size of groups x group size.
    while len(kept) > 1 and (len(kept) * s.group_size) % dist.world_size:
        kept.pop()
    episodes = [e for group in kept for e in group]
    group_ids = torch.tensor([g for g, group in enumerate(kept) for _ in group])
    rewards, turn_rewards, turn_mask, details = _score_episodes(episodes, answer_rewards, cfg, variant)
    if not variant.dynamic_sampling:
        from flowrl.core.advantages import zero_std_fraction

        zero_std_groups = round(zero_std_fraction(rewards, group_ids) * len(kept))
    for e in all_played:
        stats["episodes"] += 1
        for key in ("truncated", "empty", "malformed", "tool_call", "turn_limit"):
            stats[key] += e.counts[key]
    stats.update({"rounds": float(rounds), "groups_seen": float(seen_groups), "groups_kept": float(len(kept)),
                  "zero_std_frac_sampled": zero_std_groups / max(seen_groups, 1)})
    return EpochBatch(episodes, group_ids, rewards, turn_rewards, turn_mask, details, stats)


def compute_advantages(batch: EpochBatch, cfg: Config) -> torch.Tensor:
    """``[N, K]`` per-turn advantages from the estimator named by ``algorithm.turn_credit``
    (:mod:`flowrl.core.estimators`: ``outcome`` repeats the episode's advantage on every turn it played,
    ``gigpo`` and ``turn_return`` are turn-level credit)."""
    from flowrl.core.estimators import ADVANTAGE_ESTIMATORS, CreditBatch
    from flowrl.core.turn_credit import anchor_index

    a, v = cfg.algorithm, cfg.algorithm.resolved()
    estimator = ADVANTAGE_ESTIMATORS.get(a.turn_credit)
    K = batch.turn_rewards.shape[1]
    anchors = (anchor_index([e.anchors for e in batch.episodes], batch.group_ids.tolist())
               if "anchor_ids" in estimator.needs else None)
    credit = CreditBatch(rewards=batch.rewards, group_ids=batch.group_ids, steps=list(range(K)), num_steps=K,
                         turn_rewards=batch.turn_rewards, turn_mask=batch.turn_mask, anchor_ids=anchors)
    advantages, _ = estimator(credit, normalizer=v.estimator, std_scope=v.std_scope, eps=a.eps, clip=a.adv_clip,
                              gamma=a.gamma, step_weight=a.step_weight)
    return advantages


def _conversation(episode) -> list:
    return episode.conversation[:_last_assistant(episode.conversation) + 1]


def _last_assistant(conversation) -> int:
    return max(i for i, t in enumerate(conversation) if t.role == "assistant")


def _token_advantages(inputs, turn_adv: torch.Tensor) -> torch.Tensor:
    """``[b, T]`` advantages: each trained token gets the advantage of the turn it belongs to."""
    idx = inputs.turn_index.clamp(min=0)
    adv = torch.gather(turn_adv, 1, idx.clamp(max=turn_adv.shape[1] - 1))
    return torch.where(inputs.turn_index >= 0, adv, torch.zeros_like(adv))


def _micro_batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i:i + size] for i in range(0, len(indices), size)]


def train_epoch(policy, module, optimizer, batch: EpochBatch, turn_adv: torch.Tensor, cfg: Config, dist, epoch: int,
                progress=None) -> dict[str, float]:
    """Re-score old (and reference) log-probs, then the clipped-loss updates of one epoch on this process's shard."""
    from flowrl.core.losses import clipped_policy_loss, kl_estimate

    a, v, t = cfg.algorithm, cfg.algorithm.resolved(), cfg.train
    temperature = cfg.sampling.temperature
    N = len(batch.episodes)
    rng = random.Random(_seed(cfg.run.seed, epoch, 7))
    budget = cfg.sampling.max_new_tokens * (cfg.env.max_turns or max(e.num_turns for e in batch.episodes))
    # Inputs, old and reference log-probs per micro-batch, computed once before any update.
    cache: dict[tuple[int, ...], dict] = {}

    def prepared(ids: list[int]) -> dict:
        key = tuple(ids)
        if key not in cache:
            inputs = policy.build_inputs([_conversation(batch.episodes[i]) for i in ids])
            with torch.no_grad():
                old = policy.score(inputs, temperature=temperature)
                ref = None
                if a.kl != "none":
                    with policy.reference():
                        ref = policy.score(inputs, temperature=temperature)
            cache[key] = {"inputs": inputs, "old": old, "ref": ref,
                          "adv": _token_advantages(inputs, turn_adv[ids]).to(old.device)}
        return cache[key]

    # The minibatch plan (same on every process): a permutation of the epoch's episodes per inner epoch.
    plans = []
    for _ in range(t.inner_epochs):
        order = list(range(N)) if t.inner_epochs == 1 else rng.sample(range(N), N)
        size = math.ceil(N / t.minibatches)
        plans += [order[i:i + size] for i in range(0, N, size)]
    # Old log-probs of every micro-batch first, before any update: the ratio is exactly 1 at the first update.
    for minibatch in plans:
        mine = minibatch[dist.rank * len(minibatch) // dist.world_size:(dist.rank + 1) * len(minibatch) // dist.world_size]
        for micro in _micro_batches(mine, t.micro_batch_size):
            prepared(micro)
    gap_sum = gap_n = 0.0
    for key, item in cache.items():  # rollout log-probs vs the re-scored ones (sampler / trainer mismatch)
        m = item["inputs"].loss_mask > 0
        rollout = torch.cat([torch.cat(batch.episodes[i].logprobs) for i in key]) if key else torch.zeros(0)
        rescored = item["old"].cpu()[m]
        if rollout.numel() == rescored.numel():
            gap_sum += float((rollout - rescored).abs().sum())
            gap_n += rollout.numel()

    sums: dict[str, float] = {}
    count = 0.0
    steps = 0
    params = policy.trainable_parameters()
    for minibatch in plans:
        # Global denominators of this minibatch (every process knows every episode).
        lengths = torch.tensor([sum(batch.episodes[i].action_lengths) for i in minibatch], dtype=torch.float)
        n_seq = float(len(minibatch))
        n_tok = float(lengths.sum().clamp(min=1))
        n_valid = float((lengths > 0).sum().clamp(min=1))
        mine = minibatch[dist.rank * len(minibatch) // dist.world_size:(dist.rank + 1) * len(minibatch) // dist.world_size]
        micros = _micro_batches(mine, t.micro_batch_size)
        optimizer.zero_grad(set_to_none=True)
        for j, micro in enumerate(micros):
            item = prepared(micro)
            inputs = item["inputs"]
            logp = policy.score(inputs, temperature=temperature, module=module)
            mask = inputs.loss_mask.to(logp.device)
            adv = item["adv"]
            mb_tok = float(mask.sum().clamp(min=1))
            mb_valid = float((mask.sum(1) > 0).sum().clamp(min=1))
            if v.ratio == "sequence":
                per_seq = ((logp - item["old"]) * mask).sum(1) / mask.sum(1).clamp(min=1)
                seq_adv = (adv * mask).sum(1) / mask.sum(1).clamp(min=1)
                out = clipped_policy_loss(per_seq, torch.zeros_like(per_seq), seq_adv, (mask.sum(1) > 0).float(),
                                          eps_low=v.clip_low, eps_high=v.clip_high, aggregation="token_mean")
                scale = mb_valid / n_valid
            else:
                out = clipped_policy_loss(logp, item["old"], adv, mask, eps_low=v.clip_low, eps_high=v.clip_high,
                                          aggregation=v.aggregation)
                scale = {"token_mean": mb_tok / n_tok, "seq_mean_token_mean": mb_valid / n_valid,
                         "seq_mean_token_sum": len(micro) / n_seq,
                         "seq_mean_token_sum_norm": len(micro) * mask.shape[1] / (n_seq * budget)}[v.aggregation]
            loss = out.loss * scale
            kl_value = torch.zeros(())
            if a.kl != "none":
                from flowrl.core.losses import aggregate

                kl = kl_estimate(logp, item["ref"], "k3")
                agg = "token_mean" if v.ratio == "sequence" else v.aggregation
                kl_scale = scale if v.ratio != "sequence" else mb_tok / n_tok
                kl_value = aggregate(kl, mask, agg)
                loss = loss + a.kl_beta * kl_value * kl_scale
            # DDP averages gradients over processes; the loss is already normalised globally, so undo it.
            dist.backward(loss * dist.world_size, module, sync=j == len(micros) - 1)
            w = mb_tok
            for name, value in (("train/loss", out.loss), ("train/ratio_mean", out.ratio_mean),
                                ("train/clip_frac", out.clip_frac), ("train/approx_kl", out.approx_kl),
                                ("train/kl_ref", kl_value)):
                sums[name] = sums.get(name, 0.0) + float(value.detach()) * w
            count += w
            if progress is not None:
                progress(len(micro))
        grad_norm = dist.clip_grad_norm_(params, cfg.optim.grad_clip)
        sums["train/grad_norm"] = sums.get("train/grad_norm", 0.0) + float(grad_norm)
        optimizer.step()
        steps += 1
    metrics = {k: v_ / max(count, 1.0) for k, v_ in sums.items() if k != "train/grad_norm"}
    # Per-process diagnostics are averaged over processes (token-weighted here, equal weights across ranks).
    if dist.world_size > 1:
        keys = sorted(metrics)
        gathered = dist.gather(torch.tensor([metrics[k] for k in keys], dtype=torch.float64)[None])
        metrics = {k: float(gathered[:, i].mean()) for i, k in enumerate(keys)}
    metrics["train/grad_norm"] = sums["train/grad_norm"] / max(steps, 1)
    metrics["train/optimizer_steps"] = steps
    metrics["train/lr"] = optimizer.param_groups[0]["lr"]
    metrics["train/rollout_logp_gap"] = gap_sum / max(gap_n, 1.0)
    return metrics


# ============================================================================ main


def _next_multiple(minutes: float, every: float | None) -> float | None:
    return None if every is None else (math.floor(minutes / every + 1e-9) + 1) * every


def _epoch_metrics(batch: EpochBatch, cfg: Config) -> dict[str, float]:
    from flowrl.core.advantages import zero_std_fraction

    r = batch.rewards
    eps = batch.episodes
    n = max(batch.stats["episodes"], 1.0)
    lengths = torch.tensor([float(sum(e.action_lengths)) for e in eps])
    metrics = {"train/reward_mean": float(r.mean()), "train/reward_std": float(r.std(unbiased=False)),
               "train/zero_std_frac": zero_std_fraction(r, batch.group_ids),
               "train/response_len": float(lengths.mean()), "train/turns": float(batch.turn_mask.sum(1).float().mean()),
               "train/episodes": float(len(eps))}
    for key in ("truncated", "empty", "malformed", "tool_call", "turn_limit"):
        metrics[f"train/{key}_per_episode"] = batch.stats[key] / n
    metrics.update({f"train/sampling_{k}": batch.stats[k] for k in ("rounds", "groups_kept", "zero_std_frac_sampled")})
    for name, value in batch.details.items():
        metrics[f"train/reward/{name}"] = float(value.mean())
    if cfg.env.name == "shapes_zoom":
        kinds = sorted({e.task.kind for e in eps})
        for kind in kinds:
            sel = [e for e in eps if e.task.kind == kind]
            metrics[f"train/tool_calls/{kind}"] = sum(e.counts["tool_call"] for e in sel) / len(sel)
    return metrics


def main(cfg: Config, *, policy=None, dist=None) -> int:
    """Run the configured GRPO-family algorithm. ``policy`` / ``dist`` may be injected (tests)."""
    from flowrl.checkpoint import CheckpointError, latest_checkpoint, load_state, rng_state, save_checkpoint, set_rng_state
    from flowrl.dist import Dist
    from flowrl.envs.evaluate import evaluate_policy
    from flowrl.envs.registry import get_env
    from flowrl.envs.rewards import AnswerRewards
    from flowrl.logging import MetricsLogger
    from flowrl.runtime import make_deadline
    from flowrl.runtime import GracefulStop, prepare_run

    dist = dist or Dist()
    output_dir = prepare_run(cfg.run)
    if dist.is_main:
        save_config(cfg, output_dir / "config.yaml", extra={"recipe": "vlm_grpo"})
    if policy is None:
        policy = build_policy(cfg.model, dist.device)
    policy.train()
    env_spec = get_env(cfg.env.name)
    answer_rewards = AnswerRewards(cfg.reward.answer)
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
    warmup = cfg.optim.warmup_epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: min(1.0, (e + 1) / warmup) if warmup else 1.0)
    module = dist.prepare(policy.model) if dist.world_size > 1 else policy.model
    short = cfg.env.name.removeprefix("shapes_")
    logger = MetricsLogger(output_dir, backends=cfg.log.backends, enabled=dist.is_main, project=cfg.log.project,
                           plot_groups={"reward": ["train/reward_mean", "train/reward/"], "eval": [f"eval/{short}/"],
                                        "policy": ["train/clip_frac", "train/approx_kl", "train/kl_ref"],
                                        "agent": ["train/tool_calls/", "train/malformed_per_episode",
                                                  "train/turn_limit_per_episode", "train/truncated_per_episode",
                                                  "train/empty_per_episode"],
                                        "time": ["time/"]})
    epoch, episodes_sampled, train_minutes_before, wall_minutes_before = 0, 0, 0.0, 0.0
    if cfg.run.resume:
        checkpoint = latest_checkpoint(output_dir)
        if checkpoint is None:
            raise CheckpointError(f"run.resume=true but {output_dir}/checkpoints holds no checkpoint; "
                                  "run without run.resume=true to start fresh")
        state = load_state(checkpoint)
        policy.load_trainable_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        epoch, episodes_sampled = int(state["epoch"]), int(state["episodes_sampled"])
        train_minutes_before, wall_minutes_before = float(state["train_minutes"]), float(state["wall_minutes"])
        logger.truncate_after(epoch)
        if dist.is_main:
            print(f"flowrl: resumed from {checkpoint} at epoch {epoch}")

    deadline = make_deadline(cfg.run.clock, cfg.run.max_minutes, train_minutes_before)

    def checkpoint_now() -> None:
        if not dist.is_main:
            return
        state = {"model": policy.trainable_state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "rng": rng_state(), "epoch": epoch,
                 "episodes_sampled": episodes_sampled, "train_minutes": deadline.elapsed_minutes(),
                 "wall_minutes": wall_minutes_before + deadline.wall_minutes()}
        save_checkpoint(output_dir, epoch, state, keep=cfg.checkpoint.keep)

    def evaluate() -> dict[str, float]:
        # Every process evaluates the same set (greedy, deterministic); only the main one logs.
        return evaluate_policy(policy, cfg.env.name, cfg.eval.num_examples, batch_size=cfg.eval.batch_size,
                               max_turns=cfg.env.max_turns, max_new_tokens=cfg.sampling.max_new_tokens,
                               system_prompt=cfg.env.system_prompt)

    next_eval = _next_multiple(train_minutes_before, cfg.eval.every_minutes)
    status = "finished"
    with GracefulStop() as stop:
        if epoch == 0 and cfg.eval.at_start:
            with deadline.excluded():
                metrics = evaluate()
            logger.log({"epoch": 0, "episodes_sampled": 0, "time/train_min": 0.0, **metrics})
            logger.plot()
            if dist.is_main:
                print("epoch 0: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.endswith("accuracy")))
        bar = tqdm(total=cfg.run.max_epochs, initial=epoch, desc="vlm_grpo", disable=not dist.is_main, dynamic_ncols=True)
        while epoch < cfg.run.max_epochs:
            t0 = time.perf_counter()
            batch = collect_epoch(policy, cfg, epoch, dist, answer_rewards, env_spec)
            t1 = time.perf_counter()
            turn_adv = compute_advantages(batch, cfg)
            metrics = _epoch_metrics(batch, cfg)
            metrics.update(train_epoch(policy, module, optimizer, batch, turn_adv, cfg, dist, epoch))
            scheduler.step()
            t2 = time.perf_counter()
            epoch += 1
            episodes_sampled += int(batch.stats["episodes"])
            metrics.update({"epoch": epoch, "episodes_sampled": episodes_sampled, "time/sampling_s": t1 - t0,
                            "time/training_s": t2 - t1, "time/epoch_s": t2 - t0,
                            "time/train_min": deadline.elapsed_minutes()})
            stopping = dist.any(stop.requested or deadline.passed())
            due = (cfg.eval.every_epochs is not None and epoch % cfg.eval.every_epochs == 0) or (
                next_eval is not None and deadline.elapsed_minutes() >= next_eval)
            if due or stopping or epoch == cfg.run.max_epochs:
                with deadline.excluded():
                    metrics.update(evaluate())
                next_eval = _next_multiple(deadline.elapsed_minutes(), cfg.eval.every_minutes)
            metrics["time/wall_min"] = wall_minutes_before + deadline.wall_minutes()
            logger.log(metrics)
            logger.plot()
            bar.update(1)
            acc = metrics.get(f"eval/{short}/accuracy")
            bar.set_postfix(reward=f"{metrics['train/reward_mean']:.3f}", **({"eval": f"{acc:.3f}"} if acc is not None else {}))
            if epoch % cfg.checkpoint.every_epochs == 0 or stopping or epoch == cfg.run.max_epochs:
                checkpoint_now()
            if stopping:
                status = stop.reason or "time budget reached"
                break
        bar.close()
    if dist.is_main:
        policy.save_pretrained(output_dir / "model")
    logger.close()
    if dist.is_main:
        print(f"flowrl: vlm_grpo stopped at epoch {epoch}/{cfg.run.max_epochs} ({status}); outputs in {output_dir}")
    dist.close()
    return 0


RECIPE = Recipe(Config, main)
