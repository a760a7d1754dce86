"""GRPO and its family for VLM / LM agents: GRPO, Dr.GRPO, DAPO, RLOO and GSPO, single- or multi-turn.

Papers: Shao et al. 2024 (DeepSeekMath, GRPO); Liu et al. 2025 ("Understanding R1-Zero-Like Training",
Dr.GRPO); Yu et al. 2025 (DAPO); Ahmadian et al. 2024 (RLOO for LLMs); Zheng et al. 2025 (GSPO); Feng et al.
2025 (GiGPO) for turn-level credit. One epoch:

1. ``groups_per_epoch`` tasks are drawn (a pure function of ``(seed, epoch, round)``), each played
   ``group_size`` times; each process plays a contiguous shard of the episodes with the policy
   (:func:`flowrl.envs.rollout.play_episodes`; per-sample seeds, so the samples do not depend on the
   number of processes), then every process gathers every episode.
2. Rewards: the answer rewards (exact match, numeric, format, ``vlm_judge``) of each episode's final answer
   plus the environment's per-turn rewards (e.g. -0.05 per tool call), plus DAPO's overlong penalty. An episode of
   several questions (``env.questions_per_episode``) is scored per answer turn against its own question
   (``all_right``: 1 only when every answer is right). DAPO's
   dynamic sampling drops groups whose rewards are all equal and plays more rounds until the epoch has
   ``groups_per_epoch`` informative groups (at most ``max_sampling_rounds``).
3. Advantages on the whole epoch (``flowrl.core``; the image recipes' ``advantage`` section, one class):
   the ``outcome`` estimator with the ``group`` normaliser (GRPO, DAPO, GSPO; without std for Dr.GRPO) or the
   leave-one-out one (``rloo``, RLOO) per episode; or per turn with the GiGPO / discounted turn return / TRLOO
   estimators. Each token of an action gets its turn's advantage; with ``algorithm.step_credit`` the tokens of each
   reasoning step also get that step's own ``consistent`` check's group-normalised value
   (:mod:`flowrl.envs.step_credit`).
4. Off-policy (several minibatches or inner epochs), old log-probs are re-scored with the same inputs and
   micro-batches training will use, before any update; on-policy (one minibatch, one inner epoch) that pass
   is skipped and the training forward's own log-probs, detached, are the old ones (ratio exactly 1, the
   same gradient, ~20-25% less compute). The reference's log-probs are scored when KL is on. Then for each
   inner epoch and minibatch: clipped policy loss (token ratio; GSPO: sequence ratio
   ``exp(mean_t log ratio)``), plus ``train.kl_coef * k3`` KL to the reference (LoRA adapters off, or a
   frozen copy), accumulated over micro-batches, one optimizer step per minibatch. ``train/entropy`` is the
   policy's (tempered) entropy per trained token, from the training forward.

Choices and departures (docs/vlm.md has the formulas):
- the loss is normalised by *global* counts (tokens, sequences, or sequences x the token budget for
  Dr.GRPO's ``seq_mean_token_sum_norm``) of the minibatch, so one process with accumulation ``2a`` and two
  processes with accumulation ``a`` take the same step;
- log-probs are those of ``softmax(logits / temperature)``; top-p only shapes sampling;
- the rollout's own log-probs are kept for diagnostics (``train/rollout_logp_gap``), not used as the old
  policy: a generation kernel (KV cache) rounds differently from a full forward pass, and on-policy the
  forward's own detached log-probs cost nothing and make the ratio exactly 1;
- a malformed tool call, an empty answer or a cut-off action is counted and scored as what it is, never an
  error.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.policies.config import PolicyConfig, build_policy
from flowrl.recipes import Recipe
from flowrl.rl.epoch_advantages import TURN_INPUTS, AdvantageConfig
from flowrl.rl.optim import OptimConfig
from flowrl.run.harness import CheckpointConfig, EvalSchedule, LogConfig

__all__ = ["Config", "main", "RECIPE", "VARIANTS", "Variant", "train_epoch", "build_policy", "prepare_training"]


# ============================================================================ variants


@dataclass(frozen=True)
class Variant:
    """The defaults one algorithm sets; a config value that is not null overrides them (:meth:`Config.variant`).

    ``normalizer`` is the outcome normalisation of :mod:`flowrl.core.estimators`, as ``advantage.normalizer`` of the
    image recipes: ``group`` (group mean, and the std of ``std_scope``) or ``rloo`` (the leave-one-out baseline)."""

    normalizer: Literal["group", "rloo"] = "group"
    std_scope: Literal["group", "batch", "none"] = "group"
    aggregation: str = "seq_mean_token_mean"
    clip_range: float = 0.2
    clip_range_high: float = 0.2
    ratio: Literal["token", "sequence"] = "token"
    dynamic_sampling: bool = False
    overlong_penalty: bool = False


VARIANTS: dict[str, Variant] = {
    # DeepSeekMath: group mean / std, per-sequence token means, symmetric clip.
    "grpo": Variant(),
    # Dr.GRPO: no std division, no per-sequence length normalisation (sum / (B * token budget)).
    "dr_grpo": Variant(std_scope="none", aggregation="seq_mean_token_sum_norm"),
    # DAPO: clip-higher, token-level mean, dynamic sampling, soft overlong penalty.
    "dapo": Variant(aggregation="token_mean", clip_range_high=0.28, dynamic_sampling=True, overlong_penalty=True),
    # RLOO: the leave-one-out normaliser, no std.
    "rloo": Variant(normalizer="rloo", std_scope="none", aggregation="seq_mean_token_mean"),
    # GSPO: sequence-level ratio exp(mean_t log ratio), clipped to a very narrow range.
    "gspo": Variant(ratio="sequence", clip_range=3e-4, clip_range_high=4e-4),
}


# ============================================================================ config


@dataclass
class EnvConfig:
    name: Literal["shapes_vqa", "shapes_zoom"] = "shapes_vqa"
    kinds: list[str] | None = None  # None: every kind of the environment
    max_turns: int | None = field(default=None, metadata=bounds(ge=1))  # None: the environment's default
    system_prompt: str | None = None  # a system turn before the first observation (e.g. an answer format)
    # shapes_vqa: this fraction of each epoch's groups ask position by colour (train-only, every colour pair both
    # ways, flowrl.data.vqa.sample_color_position), as the shipped model's SFT data did (0.2).
    color_position_fraction: float = field(default=0.0, metadata=bounds(ge=0, le=1))
    # shapes_vqa: questions about one image per episode, one per turn (flowrl/envs/vqa.py); reward.answer's
    # all_right pays only when every answer is right. Evaluation adds eval/vqa_multi/ (all_right, per question).
    questions_per_episode: int = field(default=1, metadata=bounds(ge=1, le=4))
    # shapes_vqa: a named held-out split, e.g. ["red circle", "circle left of triangle"] (colour-shape pairs,
    # relations between shapes): training never asks them; eval/vqa/ is then in distribution (training questions
    # on new scenes) and eval/vqa_heldout/ the held-out combinations. null: the default split (flowrl/data/vqa.py).
    heldout_combinations: list[str] | None = None

    def check(self) -> None:
        """The shapes_vqa options against the environment (the config loader raises them as ``env.<field>``)."""
        if self.color_position_fraction and self.name != "shapes_vqa":
            fail("color_position_fraction", f"position questions by colour are shapes_vqa tasks, not "
                 f"{self.name}'s; set it to 0")
        for key, unset in (("questions_per_episode", 1), ("heldout_combinations", None)):
            if getattr(self, key) != unset and self.name != "shapes_vqa":
                fail(key, f"an option of shapes_vqa, not of {self.name}; remove it")
        if self.max_turns is not None and self.max_turns < self.questions_per_episode:
            fail("max_turns", f"{self.max_turns} turns cannot answer {self.questions_per_episode} questions "
                 "(one per turn); raise it or leave it null")
        if self.heldout_combinations is not None:
            from flowrl.data.vqa import parse_combinations, split_questions

            try:
                split_questions("train", parse_combinations(self.heldout_combinations))
            except ValueError as err:
                fail("heldout_combinations", str(err))


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
    # The vision tower and prompt forward once per distinct prompt (a group's members share theirs), the cache
    # copied to each member; same tokens and log-probs up to float rounding (flowrl.policies.TokenPolicy.generate).
    share_prompts: bool = True


@dataclass
class AlgorithmConfig:
    variant: str = "grpo"  # grpo | dr_grpo | dapo | rloo | gspo
    # null: the variant's default (see VARIANTS)
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                         "seq_mean_token_sum_norm"] | None = None
    dynamic_sampling: bool | None = None
    overlong_penalty: bool | None = None
    overlong_cache: int | None = field(default=None, metadata=bounds(ge=1))  # None: a quarter of the budget
    kl: Literal["none", "k3"] = "none"
    # Each `consistent` check's own advantage, times this weight, on the tokens of the step it judges (Shapes-VQA
    # reasoning traces; flowrl/envs/step_credit.py), beside the episode's advantage. 0: off.
    step_credit: float = field(default=0.0, metadata=bounds(ge=0))


@dataclass
class TrainConfig:
    inner_epochs: int = field(default=1, metadata=bounds(ge=1))
    minibatches: int = field(default=1, metadata=bounds(ge=1))  # optimizer steps per inner epoch
    micro_batch_size: int = field(default=32, metadata=bounds(ge=1))  # episodes per backward, per process
    # The ratio clip [1 - clip_range, 1 + clip_range_high]; null: the variant's (see VARIANTS).
    clip_range: float | None = field(default=None, metadata=bounds(ge=0, lt=1))
    clip_range_high: float | None = field(default=None, metadata=bounds(ge=0))
    kl_coef: float = field(default=0.0, metadata=bounds(ge=0))  # weight of the k3 KL to the reference


@dataclass
class RewardConfig:
    # name -> weight, or name -> {weight, kwargs} (flowrl/envs/rewards.py: exact, numeric, format, vlm_judge)
    answer: dict[str, Any] = field(default_factory=lambda: {"exact": 1.0})


@dataclass
class EvalConfig(EvalSchedule):
    every_minutes: float | None = field(default=10.0, metadata=bounds(gt=0))
    num_examples: int = field(default=500, metadata=bounds(ge=1))
    batch_size: int = field(default=100, metadata=bounds(ge=1))
    baselines: bool = True  # shapes_zoom: also the one-turn overview and full-resolution crop baselines


@dataclass
class Config:
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/vlm_grpo", max_epochs=100))
    model: PolicyConfig = field(default_factory=PolicyConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # The learning-rate schedule steps once per epoch (flowrl.rl.optim.SCHEDULE_UNITS).
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, weight_decay=0.0))
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every_epochs=20))

    def variant(self) -> Variant:
        """The algorithm's settings: its variant's (:data:`VARIANTS`) with this config's non-null values over them
        (``algorithm.aggregation`` / ``dynamic_sampling`` / ``overlong_penalty``, ``advantage.normalizer`` /
        ``std_scope``, ``train.clip_range`` / ``clip_range_high``)."""
        chosen = {"normalizer": self.advantage.normalizer, "std_scope": self.advantage.std_scope,
                  "aggregation": self.algorithm.aggregation, "dynamic_sampling": self.algorithm.dynamic_sampling,
                  "overlong_penalty": self.algorithm.overlong_penalty, "clip_range": self.train.clip_range,
                  "clip_range_high": self.train.clip_range_high}
        return replace(VARIANTS[self.algorithm.variant], **{k: v for k, v in chosen.items() if v is not None})

    def check(self) -> None:
        a = self.algorithm
        if a.variant not in VARIANTS:
            fail("algorithm.variant", f"got {a.variant!r}, expected one of {', '.join(VARIANTS)}")
        self.advantage.check_loop("VLM episodes", TURN_INPUTS, normalizers=("group", "rloo"), controls=False)
        v = self.variant()
        if v.ratio == "sequence" and self.advantage.estimator != "outcome":
            fail("advantage.estimator", "gspo's sequence-level ratio needs one advantage per episode; use "
                 "estimator: outcome")
        if v.ratio == "sequence" and a.step_credit:
            fail("algorithm.step_credit", "gspo's sequence-level ratio needs one advantage per episode, and step "
                 "credit gives each step its own; set it to 0 or use another variant")
        if a.kl != "none" and self.train.kl_coef == 0:
            fail("train.kl_coef", f"algorithm.kl is {a.kl!r} but train.kl_coef is 0; set kl_coef > 0 or kl: none")
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


def train_epoch(policy, module, optimizer, batch, turn_adv: torch.Tensor, cfg: Config, dist, epoch: int,
                progress=None, health=None, step_adv: list | None = None) -> dict[str, float]:
    """The clipped-loss updates of one epoch on this process's shard.

    Off-policy updates (several minibatches or inner epochs) re-score the old (and reference) log-probs
    before any update. On-policy (one minibatch, one inner epoch) there is no such pass: the old log-probs
    are the training forward's own, detached (ratio exactly 1, the same gradient), and the rollout's are
    compared with them for ``train/rollout_logp_gap``.

    Args:
        turn_adv: ``[N, K]`` per-turn advantages of the epoch's ``N`` episodes.
        step_adv: per episode, per action, ``[n_tokens]`` advantages added to its tokens' (``algorithm.step_credit``:
            :func:`flowrl.envs.step_credit.step_credit`); None: none.
        health: the run's :class:`flowrl.run.updates.UpdateHealth`: every optimizer step goes through
            :func:`flowrl.run.updates.optimizer_step`, which skips (and counts) an update whose loss or gradient is
            not finite, so ``run.max_nonfinite_updates`` stops a run whose updates keep failing.
    """
    from flowrl.core.losses import aggregate, clipped_policy_loss, kl_estimate
    from flowrl.envs.epoch import (micro_batches, minibatch_plan, rollout_logp_gap, shard, token_advantages,
                                   trained_conversation)
    from flowrl.envs.rollout import sample_seed
    from flowrl.run.updates import optimizer_step

    a, v, t = cfg.algorithm, cfg.variant(), cfg.train
    temperature = cfg.sampling.temperature
    N = len(batch.episodes)
    on_policy = t.inner_epochs == 1 and t.minibatches == 1
    budget = cfg.sampling.max_new_tokens * (cfg.env.max_turns or max(e.num_turns for e in batch.episodes))
    # Inputs (and old / reference log-probs when needed) per micro-batch, computed once before any update.
    cache: dict[tuple[int, ...], dict] = {}

    def prepared(ids: list[int]) -> dict:
        key = tuple(ids)
        if key not in cache:
            inputs = policy.build_inputs([trained_conversation(batch.episodes[i]) for i in ids])
            with torch.no_grad():
                old = None if on_policy else policy.score(inputs, temperature=temperature)
                ref = None
                if a.kl != "none":
                    with policy.reference():
                        ref = policy.score(inputs, temperature=temperature)
            adv = token_advantages(inputs, turn_adv[ids])
            if step_adv is not None:
                from flowrl.envs.step_credit import place_token_credit

                adv = adv + place_token_credit(inputs.turn_index, [step_adv[i] for i in ids])
            cache[key] = {"inputs": inputs, "old": old, "ref": ref, "adv": adv.to(policy.device)}
        return cache[key]

    plans = minibatch_plan(N, t.inner_epochs, t.minibatches, random.Random(sample_seed(cfg.run.seed, epoch, 7)))
    # Inputs (off-policy: old log-probs) of every micro-batch first, before any update: the ratio is 1 at the first.
    for minibatch in plans:
        for micro in micro_batches(shard(minibatch, dist), t.micro_batch_size):
            prepared(micro)
    scored: dict[tuple[int, ...], tuple] = {}  # micro-batch -> (loss mask, log-probs of the first pass)

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
        micros = micro_batches(shard(minibatch, dist), t.micro_batch_size)
        optimizer.zero_grad(set_to_none=True)
        for j, micro in enumerate(micros):
            item = prepared(micro)
            inputs = item["inputs"]
            logp, entropy = policy.score(inputs, temperature=temperature, module=module, with_entropy=True)
            mask = inputs.loss_mask.to(logp.device)
            old = item["old"] if item["old"] is not None else logp.detach()
            scored.setdefault(tuple(micro), (inputs.loss_mask, old))
            adv = item["adv"]
            mb_tok = float(mask.sum().clamp(min=1))
            mb_valid = float((mask.sum(1) > 0).sum().clamp(min=1))
            if v.ratio == "sequence":
                per_seq = ((logp - old) * mask).sum(1) / mask.sum(1).clamp(min=1)
                seq_adv = (adv * mask).sum(1) / mask.sum(1).clamp(min=1)
                out = clipped_policy_loss(per_seq, torch.zeros_like(per_seq), seq_adv, (mask.sum(1) > 0).float(),
                                          clip_range=v.clip_range, clip_range_high=v.clip_range_high,
                                          aggregation="token_mean")
                scale = mb_valid / n_valid
            else:
                out = clipped_policy_loss(logp, old, adv, mask, clip_range=v.clip_range,
                                          clip_range_high=v.clip_range_high, aggregation=v.aggregation)
                scale = {"token_mean": mb_tok / n_tok, "seq_mean_token_mean": mb_valid / n_valid,
                         "seq_mean_token_sum": len(micro) / n_seq,
                         "seq_mean_token_sum_norm": len(micro) * mask.shape[1] / (n_seq * budget)}[v.aggregation]
            loss = out.loss * scale
            kl_value = torch.zeros(())
            if a.kl != "none":
                kl = kl_estimate(logp, item["ref"], "k3")
                agg = "token_mean" if v.ratio == "sequence" else v.aggregation
                kl_scale = scale if v.ratio != "sequence" else mb_tok / n_tok
                kl_value = aggregate(kl, mask, agg)
                loss = loss + t.kl_coef * kl_value * kl_scale
            # DDP averages gradients over processes; the loss is already normalised globally, so undo it.
            dist.backward(loss * dist.world_size, module, sync=j == len(micros) - 1)
            w = mb_tok
            for name, value in (("train/loss", out.loss), ("train/ratio_mean", out.ratio_mean),
                                ("train/clip_frac", out.clip_frac), ("train/approx_kl", out.approx_kl),
                                ("train/kl_ref", kl_value), ("train/entropy", (entropy * mask).sum() / mb_tok)):
                sums[name] = sums.get(name, 0.0) + float(value.detach()) * w
            count += w
            if progress is not None:
                progress(len(micro))
        # Clip, step; a non-finite gradient skips the update (the weights stay finite) and counts toward
        # run.max_nonfinite_updates.
        grad_norm = optimizer_step(optimizer, params, dist, grad_clip=cfg.optim.grad_clip, health=health)
        sums["train/grad_norm"] = sums.get("train/grad_norm", 0.0) + grad_norm
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
    metrics["train/rollout_logp_gap"] = rollout_logp_gap(batch.episodes, scored)
    return metrics


def _step_credit(batch, policy, cfg: Config, variant: Variant) -> list:
    """``algorithm.step_credit``'s token advantages of the epoch (:func:`flowrl.envs.step_credit.step_credit`), with
    the outcome's normalisation."""
    from flowrl.envs.step_credit import step_credit

    def decode(ids):
        return policy.tokenizer.decode(ids, skip_special_tokens=True)

    return step_credit(batch.episodes, batch.group_ids, decode, weight=cfg.algorithm.step_credit,
                       normalizer=variant.normalizer, std_scope=variant.std_scope, eps=cfg.advantage.eps,
                       clip=cfg.advantage.clip)


def prepare_training(run, cfg, policy=None):
    """The setup every online VLM recipe (``vlm_grpo``, ``vlm_rft``) shares, after its :class:`Run` is built: the
    policy (``policy``, or built from ``cfg.model``) in train mode, the environment, the answer rewards, the
    optimizer and its per-epoch scheduler, the module DDP wraps (the policy's own model on one process), the
    tracked state (weights, optimizer, scheduler) and the greedy held-out evaluation (every process evaluates the
    same set; only the main one logs).

    Returns:
        ``(policy, env_spec, answer_rewards, optimizer, scheduler, module)``.
    """
    from flowrl.envs.evaluate import evaluate_with_baselines
    from flowrl.envs.registry import env_options, get_env
    from flowrl.envs.rewards import AnswerRewards
    from flowrl.rl.optim import build_optimizer
    from flowrl.run.checkpoints import TrainableWeights

    dist = run.dist
    if policy is None:
        policy = build_policy(cfg.model, dist.device)
    policy.train()
    options = env_options(cfg.env)
    env_spec = get_env(cfg.env.name, **options)
    optimizer, scheduler = build_optimizer(policy.trainable_parameters(), cfg.optim, schedule_unit="epoch",
                                           max_epochs=cfg.run.max_epochs)
    module = dist.prepare(policy.model) if dist.world_size > 1 else policy.model
    run.track(model=TrainableWeights(policy), optimizer=optimizer, scheduler=scheduler)
    run.evaluation(lambda epoch, should_stop: evaluate_with_baselines(
        policy, cfg.env.name, cfg.eval.num_examples, baselines=cfg.eval.baselines, batch_size=cfg.eval.batch_size,
        max_turns=cfg.env.max_turns, max_new_tokens=cfg.sampling.max_new_tokens, system_prompt=cfg.env.system_prompt,
        env_options=options))
    return policy, env_spec, AnswerRewards(cfg.reward.answer), optimizer, scheduler, module


def main(cfg: Config, *, policy=None, dist=None) -> int:
    """Run the configured GRPO-family algorithm. ``policy`` / ``dist`` may be injected (tests)."""
    from flowrl.config import to_dict
    from flowrl.envs.epoch import collect_epoch, epoch_metrics, turn_advantages
    from flowrl.run.harness import Run

    short = cfg.env.name.removeprefix("shapes_")
    # The policy computes in model.dtype; the reference clock's probe keeps the CPU's default precision.
    run = Run(cfg.run, "vlm_grpo", schedule=cfg.eval, log=cfg.log, checkpoint=cfg.checkpoint, precision=None,
              reward=str(cfg.reward.answer), config=to_dict(cfg), dist=dist, counters=("episodes_sampled",),
              plots={"reward": ["train/reward_mean", "train/reward/"],
                     "eval": [f"eval/{short}/", f"eval/{short}_heldout/", f"eval/{short}_multi/"],
                     "policy": ["train/clip_frac", "train/approx_kl", "train/kl_ref", "train/entropy",
                                "train/rollout_entropy", "train/mixed_groups/"],
                     "agent": ["train/tool_calls/", "train/malformed_per_episode", "train/turn_limit_per_episode",
                               "train/truncated_per_episode", "train/empty_per_episode"]},
              units={"reward": "episode reward", "eval": "held-out accuracy", "policy": "fraction / KL, entropy (nats)",
                     "agent": "per episode"})
    dist = run.dist
    policy, env_spec, answer_rewards, optimizer, scheduler, module = prepare_training(run, cfg, policy)
    variant = cfg.variant()

    with run:
        while run.next_epoch():
            start = time.perf_counter()
            batch = collect_epoch(policy, run.epoch, dist, answer_rewards, env_spec, env=cfg.env,
                                  sampling=cfg.sampling, variant=variant, seed=cfg.run.seed,
                                  overlong_cache=cfg.algorithm.overlong_cache)
            collected = time.perf_counter()
            metrics = epoch_metrics(batch, cfg.env.name)
            if run.check_rewards(metrics, len(batch.episodes)):
                turn_adv = turn_advantages(batch, cfg.advantage, variant)
                step_adv = None
                if cfg.algorithm.step_credit:
                    step_adv = _step_credit(batch, policy, cfg, variant)
                    tokens = torch.cat([t for actions in step_adv for t in actions])
                    metrics["train/step_credit_tokens"] = float((tokens != 0).float().mean()) if len(tokens) else 0.0
                with run.updating():
                    metrics.update(train_epoch(policy, module, optimizer, batch, turn_adv, cfg, dist, run.epoch,
                                               health=run.health, step_adv=step_adv))
            scheduler.step()
            metrics.update({"time/sampling_s": collected - start, "time/training_s": time.perf_counter() - collected})
            run.end_epoch(metrics, episodes_sampled=int(batch.stats["episodes"]))
    if dist.is_main:
        policy.save_pretrained(run.output_dir / "model")
    return run.finish()


RECIPE = Recipe(Config, main)
