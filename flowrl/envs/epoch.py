"""One epoch of a VLM / LM agent recipe (``flowrl/recipes/vlm_grpo.py``): play each group's episodes, score them,
and turn their rewards into per-turn advantages; the image side's counterpart is :mod:`flowrl.rl.collect`.

The functions take the sections they read (the recipe's ``env``, ``sampling`` and ``advantage`` sections, the
resolved algorithm variant: :class:`flowrl.recipes.vlm_grpo.Variant`) and plain values, never the recipe's whole
config; the answer rewards are the :class:`flowrl.envs.rewards.AnswerRewards` the recipe built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["EpochBatch", "score_episodes", "answer_scores", "collect_epoch", "epoch_tasks", "turn_advantages",
           "epoch_metrics", "trained_conversation", "rollout_logp_gap", "token_advantages", "micro_batches",
           "minibatch_plan", "shard"]


def _seed(*parts: int) -> int:
    from flowrl.envs.rollout import sample_seed

    return sample_seed(*parts)


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


def score_episodes(episodes: list, answer_rewards, variant, *, max_new_tokens: int, overlong_cache: int | None):
    """Episode rewards, per-turn rewards and components.

    Args:
        episodes: ``N`` played episodes.
        answer_rewards: the recipe's :class:`flowrl.envs.rewards.AnswerRewards`.
        variant: the resolved algorithm variant (its ``overlong_penalty``).
        max_new_tokens: the token budget of one action (``sampling.max_new_tokens``).
        overlong_cache: DAPO's soft-penalty window in tokens (``algorithm.overlong_cache``; None: a quarter of the
            budget).

    Returns:
        ``(rewards [N], turn_rewards [N, K], turn_mask [N, K] bool, details {name: [N]})``.
    """
    scores, details = answer_scores(answer_rewards, episodes)
    answered = torch.tensor([float(e.answered) for e in episodes])
    scores = scores * answered  # an episode that hit the turn limit answered nothing
    details = {k: v * answered for k, v in details.items()}
    K = max(e.num_turns for e in episodes)
    turn_rewards = torch.zeros(len(episodes), K)
    turn_mask = torch.zeros(len(episodes), K, dtype=torch.bool)
    overlong = torch.zeros(len(episodes))
    if variant.overlong_penalty:
        # DAPO's soft overlong punishment on the episode's generated tokens, against the whole budget.
        budget = max_new_tokens
        cache = overlong_cache or max(budget // 4, 1)
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


def answer_scores(answer_rewards, episodes: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(scores [N], {name: [N]})``: the answer rewards of ``N`` episodes. Rewards read the whole final turn (each
    extracts the answer itself; ``grounded`` and ``format`` need the rest); an episode of several questions is scored
    per question, each answer turn against its own question (:func:`flowrl.envs.vqa.episode_questions`,
    :meth:`flowrl.envs.rewards.AnswerRewards.by_episode`)."""
    from flowrl.envs.vqa import episode_questions

    pairs = [episode_questions(e) for e in episodes]
    return answer_rewards.by_episode([p[0] for p in pairs], [p[1] for p in pairs], [e.image for e in episodes])


def epoch_tasks(env_spec, n: int, seed: int, kinds: tuple[str, ...], *, color_position_fraction: float = 0.0) -> list:
    """One sampling round's ``n`` training tasks (shapes_vqa: ``color_position_fraction`` of them ask position by
    colour, ``env.color_position_fraction``)."""
    share = color_position_fraction
    extra = {"color_position_fraction": share} if share else {}
    return env_spec.train_tasks("train", n, seed=seed, kinds=kinds, **extra)


def collect_epoch(policy, epoch: int, dist, answer_rewards, env_spec, *, env, sampling, variant, seed: int,
                  overlong_cache: int | None = None, progress=None) -> EpochBatch:
    """Play the epoch's episodes (sharded over processes, gathered), score them, and (DAPO) refill groups whose
    rewards are all equal until ``groups_per_epoch`` informative groups are found.

    Args:
        policy / epoch / dist: the :class:`flowrl.policies.TokenPolicy`, the epoch index, the run's
            :class:`flowrl.dist.Dist`.
        answer_rewards / env_spec: the recipe's :class:`flowrl.envs.rewards.AnswerRewards` and environment.
        env / sampling: the recipe's ``env`` and ``sampling`` sections.
        variant: the resolved algorithm variant (``dynamic_sampling``, ``overlong_penalty``).
        seed: the run's seed (``run.seed``); every task and sample derives from ``(seed, epoch, round)``.
        overlong_cache: ``algorithm.overlong_cache`` (:func:`score_episodes`).
    """
    from flowrl.envs.rollout import SamplingSettings, play_episodes

    s = sampling
    kinds = tuple(env.kinds or env_spec.kinds)
    settings = SamplingSettings(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                stop_strings=tuple(s.stop_strings), batch_size=s.batch_size,
                                share_prompts=s.share_prompts)
    max_turns = env.max_turns or env_spec.max_turns
    kept: list[list] = []
    rounds, seen_groups, zero_std_groups = 0, 0, 0
    stats = {"truncated": 0.0, "empty": 0.0, "malformed": 0.0, "tool_call": 0.0, "turn_limit": 0.0, "episodes": 0.0}
    rounds_allowed = s.max_sampling_rounds if variant.dynamic_sampling else 1
    all_played = []
    while rounds < rounds_allowed and len(kept) < s.groups_per_epoch:
        round_seed = _seed(seed, epoch, rounds)
        tasks = epoch_tasks(env_spec, s.groups_per_epoch, round_seed % (2**31), kinds,
                            color_position_fraction=env.color_position_fraction)
        flat = [t for t in tasks for _ in range(s.group_size)]
        n = len(flat)
        per = math.ceil(n / dist.world_size)
        lo, hi = dist.rank * per, min((dist.rank + 1) * per, n)
        mine = play_episodes(policy, env_spec.make, flat[lo:hi], list(range(lo, hi)), seed=round_seed,
                             sampling=settings, max_turns=max_turns, system_prompt=env.system_prompt)
        if progress is not None:
            progress(len(mine))
        episodes = dist.gather_object(mine) if dist.world_size > 1 else mine
        groups = [episodes[g * s.group_size:(g + 1) * s.group_size] for g in range(s.groups_per_epoch)]
        seen_groups += len(groups)
        if variant.dynamic_sampling:  # keep only groups whose rewards differ (scored here to decide)
            rewards = score_episodes(episodes, answer_rewards, variant, max_new_tokens=s.max_new_tokens,
                                     overlong_cache=overlong_cache)[0]
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
    rewards, turn_rewards, turn_mask, details = score_episodes(episodes, answer_rewards, variant,
                                                               max_new_tokens=s.max_new_tokens,
                                                               overlong_cache=overlong_cache)
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


def turn_advantages(batch: EpochBatch, advantage, variant) -> torch.Tensor:
    """``[N, K]`` per-turn advantages from the estimator named by ``advantage.estimator``
    (:mod:`flowrl.core.estimators`: ``outcome`` repeats the episode's advantage on every turn it played,
    ``gigpo``, ``turn_return`` and ``trloo`` are turn-level credit).

    Args:
        batch: the epoch's episodes and rewards.
        advantage: the recipe's ``advantage`` section (``estimator``, ``eps``, ``clip``, ``gamma``, ``step_weight``).
        variant: the resolved algorithm variant (its ``normalizer`` and ``std_scope``).
    """
    from flowrl.core.estimators import ADVANTAGE_ESTIMATORS, CreditBatch
    from flowrl.core.turn_credit import anchor_index

    a, v = advantage, variant
    estimator = ADVANTAGE_ESTIMATORS.get(a.estimator)
    K = batch.turn_rewards.shape[1]
    anchors = (anchor_index([e.anchors for e in batch.episodes], batch.group_ids.tolist())
               if "anchor_ids" in estimator.needs else None)
    credit = CreditBatch(rewards=batch.rewards, group_ids=batch.group_ids, steps=list(range(K)), num_steps=K,
                         turn_rewards=batch.turn_rewards, turn_mask=batch.turn_mask, anchor_ids=anchors)
    advantages, _ = estimator(credit, normalizer=v.normalizer, std_scope=v.std_scope, eps=a.eps, clip=a.clip,
                              gamma=a.gamma, step_weight=a.step_weight)
    return advantages


def epoch_metrics(batch: EpochBatch, env_name: str) -> dict[str, float]:
    """The epoch's ``train/...`` metrics of its episodes (``env_name``: ``env.name``; the zoom environment adds its
    tool calls per kind).

    Every epoch, whatever the update does with the episodes, two measures of how much the policy still explores:
    ``train/rollout_entropy``, minus the mean log-prob of the sampled tokens (a Monte Carlo estimate of the sampling
    policy's entropy per token at the sampling temperature; with top-p below 1 it overstates it, the log-probs being
    those of the untruncated distribution), and ``train/mixed_groups/<name>``, the share of groups whose reward
    component ``<name>`` is not the same for every member (``reward``: the total, ``1 - train/zero_std_frac``; with
    ``exact``, the groups whose answers are right and wrong both: where a correctness advantage is not zero)."""
    from flowrl.core.advantages import zero_std_fraction

    r = batch.rewards
    eps = batch.episodes
    n = max(batch.stats["episodes"], 1.0)
    lengths = torch.tensor([float(sum(e.action_lengths)) for e in eps])
    metrics = {"train/reward_mean": float(r.mean()), "train/reward_std": float(r.std(unbiased=False)),
               "train/zero_std_frac": zero_std_fraction(r, batch.group_ids),
               "train/nan_rewards": int((~torch.isfinite(r)).sum()),
               "train/response_len": float(lengths.mean()), "train/turns": float(batch.turn_mask.sum(1).float().mean()),
               "train/episodes": float(len(eps))}
    for key in ("truncated", "empty", "malformed", "tool_call", "turn_limit"):
        metrics[f"train/{key}_per_episode"] = batch.stats[key] / n
    metrics.update({f"train/sampling_{k}": batch.stats[k] for k in ("rounds", "groups_kept", "zero_std_frac_sampled")})
    for name, value in batch.details.items():
        metrics[f"train/reward/{name}"] = float(value.mean())
    for name, value in {"reward": r, **batch.details}.items():
        metrics[f"train/mixed_groups/{name}"] = 1.0 - zero_std_fraction(value, batch.group_ids)
    sampled = [lp for e in eps for lp in e.logprobs]
    if sampled:
        logprobs = torch.cat([lp.float().flatten() for lp in sampled])
        metrics["train/rollout_entropy"] = float(-logprobs.mean()) if logprobs.numel() else 0.0
    if env_name == "shapes_zoom":
        kinds = sorted({e.task.kind for e in eps})
        for kind in kinds:
            sel = [e for e in eps if e.task.kind == kind]
            metrics[f"train/tool_calls/{kind}"] = sum(e.counts["tool_call"] for e in sel) / len(sel)
    return metrics


def trained_conversation(episode) -> list:
    """The turns of ``episode`` up to its last assistant turn (what training scores)."""
    last = max(i for i, t in enumerate(episode.conversation) if t.role == "assistant")
    return episode.conversation[:last + 1]


def rollout_logp_gap(episodes: list, rescored: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean ``|rollout log-prob - re-scored log-prob|`` over the trained tokens: the sampler / trainer mismatch.

    Args:
        episodes: the epoch's episodes (each keeps its rollout's per-action log-probs).
        rescored: ``{episode ids: (loss mask [b, T], re-scored log-probs [b, T])}`` per micro-batch.
    """
    total = count = 0.0
    for ids, (mask, logp) in rescored.items():
        rollout = torch.cat([torch.cat(episodes[i].logprobs) for i in ids]) if ids else torch.zeros(0)
        trained = logp.cpu()[mask > 0]
        if rollout.numel() == trained.numel():
            total += float((rollout - trained).abs().sum())
            count += rollout.numel()
    return total / max(count, 1.0)


def token_advantages(inputs, turn_adv: torch.Tensor) -> torch.Tensor:
    """``[b, T]`` advantages: each trained token gets the advantage of the turn it belongs to."""
    idx = inputs.turn_index.clamp(min=0)
    adv = torch.gather(turn_adv, 1, idx.clamp(max=turn_adv.shape[1] - 1))
    return torch.where(inputs.turn_index >= 0, adv, torch.zeros_like(adv))


def micro_batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i:i + size] for i in range(0, len(indices), size)]


def minibatch_plan(n: int, inner_epochs: int, minibatches: int, rng) -> list[list[int]]:
    """The epoch's minibatches (the same on every process): the episodes in order for one inner epoch, a
    fresh permutation per inner epoch otherwise, cut into ``minibatches`` parts."""
    plans = []
    for _ in range(inner_epochs):
        order = list(range(n)) if inner_epochs == 1 else rng.sample(range(n), n)
        size = math.ceil(n / minibatches)
        plans += [order[i:i + size] for i in range(0, n, size)]
    return plans


def shard(items: list, dist) -> list:
    """This process's contiguous part of ``items``."""
    return items[dist.rank * len(items) // dist.world_size:(dist.rank + 1) * len(items) // dist.world_size]
