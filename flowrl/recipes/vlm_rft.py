"""Online rejection-sampling fine-tuning (RFT) of a VLM / LM agent: supervised training on the policy's own sampled
episodes that are right and whose reasoning is consistent.

Papers: Yuan et al. 2023 ("Scaling relationship on learning mathematical reasoning with large language models",
rejection-sampling fine-tuning, distinct reasoning paths); Dong et al. 2023 (RAFT: reward-ranked fine-tuning).
It is the control of the equal-compute comparison of issue 47 (continued SFT, GRPO, RFT from the same checkpoint):
it samples exactly as :mod:`flowrl.recipes.vlm_grpo` does (the same tasks, groups, seeds and episodes, through
:func:`flowrl.envs.epoch.collect_epoch`) and differs only in the update. One epoch:

1. ``groups_per_epoch`` tasks, each played ``group_size`` times at ``sampling.temperature``; the episodes are scored
   with ``reward.answer`` (logged only, as GRPO logs it: ``train/reward_mean`` and its components).
2. Selection (:func:`select_episodes`). An episode is *eligible* when
   - it is right: the answer reward ``train.correct`` (default ``exact``: the normalised answer equals the task's,
     :func:`flowrl.envs.rewards.exact_match`) is 1 on its final turn, and the episode answered (an episode that
     hit the turn limit answered nothing), and
   - with ``train.require_consistent`` (default), its reasoning is consistent: every check of the ``consistent``
     reward holds (:func:`flowrl.envs.rewards.consistent_match` = 1: each step of the ``<think>`` trace against
     the trace's own step before it, :func:`flowrl.data.vqa_reasoning.step_checks`, and the answer is the one the
     trace derives); a final turn without a trace fails. A task without a Shapes-VQA question spec has no checks,
     and is judged on ``train.correct`` alone.
   Within each group, with ``train.dedupe`` (default), an eligible episode whose generated tokens (every action)
   equal an earlier kept one's is dropped, and with ``train.max_per_group`` at most that many are kept (the first
   in episode order). Several processes: the kept list is cut to a multiple of the world size.
3. Update: the mean negative log-likelihood of the kept episodes' generated tokens, the tokens GRPO trains (the
   loss mask of :func:`flowrl.policies.build_inputs` on :func:`flowrl.envs.epoch.trained_conversation`: the
   actions, not the prompt, observations or tool results), ``-sum(logp * m) / sum(m)`` over each minibatch's
   tokens (global counts, so micro-batches and processes take the same step), under the model itself
   (temperature 1, as :mod:`flowrl.recipes.vlm_sft` trains; the sampling temperature only shapes sampling).
   ``train.inner_epochs`` passes over the kept episodes (a fresh order per pass when more than one), each cut into
   ``train.minibatches`` optimizer steps of ``train.micro_batch_size``-episode backward passes, every step through
   :func:`flowrl.run.updates.optimizer_step` (run health: a non-finite loss or gradient skips and counts).

An epoch that keeps nothing takes no step; to the run's health checks it is an epoch without signal, so
``run.max_degenerate_epochs`` of them in a row stop the run (a model that never answers right and consistently).

Metrics beside vlm_grpo's episode metrics (:func:`flowrl.envs.epoch.epoch_metrics`): ``train/correct_frac`` (right
answers), ``train/eligible_frac`` (right and consistent), ``train/kept_frac`` (trained, after dedupe and the cap),
``train/mixed_frac`` (groups with both eligible and ineligible episodes: those where GRPO's exact-answer advantage
would not vanish), ``train/kept_tokens``, ``train/nll`` and ``train/entropy`` (per trained token, from the training
forwards), ``train/grad_norm``, ``train/optimizer_steps``, ``train/lr``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.policies.config import PolicyConfig
from flowrl.recipes import Recipe
from flowrl.recipes.vlm_grpo import VARIANTS, EnvConfig, EvalConfig, RewardConfig, SamplingConfig, prepare_training
from flowrl.rl.optim import OptimConfig
from flowrl.run.harness import CheckpointConfig, LogConfig

__all__ = ["Config", "main", "RECIPE", "selection_scores", "select_episodes", "episodes_nll", "train_epoch"]


@dataclass
class TrainConfig:
    inner_epochs: int = field(default=1, metadata=bounds(ge=1))
    minibatches: int = field(default=1, metadata=bounds(ge=1))  # optimizer steps per inner epoch
    micro_batch_size: int = field(default=32, metadata=bounds(ge=1))  # episodes per backward, per process
    # The answer reward (flowrl/envs/rewards.py) that must be 1 for an episode to count as right; its kwargs are
    # reward.answer's when it is listed there.
    correct: str = "exact"
    require_consistent: bool = True  # also every `consistent` check of the trace (tasks with a question spec)
    dedupe: bool = True  # identical generated tokens within a group are kept once
    max_per_group: int | None = field(default=None, metadata=bounds(ge=1))  # None: every eligible episode


@dataclass
class Config:
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/vlm_rft", max_epochs=100))
    model: PolicyConfig = field(default_factory=PolicyConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # The learning-rate schedule steps once per epoch (flowrl.rl.optim.SCHEDULE_UNITS).
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, weight_decay=0.0))
    reward: RewardConfig = field(default_factory=RewardConfig)  # logged, as vlm_grpo's; selection: train.correct
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every_epochs=20))

    def check(self) -> None:
        from flowrl.envs.rewards import ANSWER_REWARDS

        if not self.reward.answer:
            fail("reward.answer", "name at least one answer reward, e.g. {exact: 1.0}")
        for name in self.reward.answer:
            if name not in ANSWER_REWARDS:
                fail("reward.answer", f"unknown answer reward {name!r}; valid: {', '.join(ANSWER_REWARDS.names())}")
        if self.train.correct not in ANSWER_REWARDS:
            fail("train.correct", f"unknown answer reward {self.train.correct!r}; valid: "
                 f"{', '.join(ANSWER_REWARDS.names())}")
        if self.env.kinds is not None:
            from flowrl.envs.registry import get_env

            valid = get_env(self.env.name).kinds
            bad = [k for k in self.env.kinds if k not in valid]
            if bad:
                fail("env.kinds", f"{bad[0]!r} is not a task kind of {self.env.name}; valid: {', '.join(valid)}")


# ============================================================================ selection


def selection_scores(episodes: list, correct: str = "exact", *, reward_spec: dict | None = None,
                     require_consistent: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(right [N] bool, consistent [N] bool)`` of played episodes. An episode of several questions
    (``env.questions_per_episode``) is right when every answer is, and consistent when every turn's trace is
    (each turn against its own question, :func:`flowrl.envs.vqa.episode_questions`).

    Args:
        correct: the answer reward that must be 1 (``train.correct``); an episode that did not answer is wrong.
        reward_spec: ``reward.answer``: the entry of ``correct`` there, if any, gives its kwargs.
        require_consistent: False: every episode counts as consistent.
    """
    from flowrl.envs.epoch import answer_scores
    from flowrl.envs.rewards import AnswerRewards, _question_spec, consistent_match
    from flowrl.envs.vqa import episode_questions

    entry = (reward_spec or {}).get(correct, 1.0)
    entry = {"weight": 1.0, "kwargs": entry.get("kwargs", {})} if isinstance(entry, dict) else 1.0
    # A mean over an episode's questions is 1 only when each is (all_right takes the minimum): right means all right.
    score = answer_scores(AnswerRewards({correct: entry}), episodes)[0]
    answered = torch.tensor([bool(e.answered) for e in episodes], dtype=torch.bool)
    right = (score >= 1.0) & answered
    consistent = torch.ones(len(episodes), dtype=torch.bool)
    if require_consistent:
        for i, episode in enumerate(episodes):
            for text, task in zip(*episode_questions(episode)):
                if _question_spec(task) is not None:  # no spec, no checks
                    consistent[i] &= bool(consistent_match([text], [task])[0] >= 1.0)
    return right, consistent


def _trace_key(episode) -> tuple:
    """The episode's generated tokens (every action), for dedupe."""
    return tuple(tuple(t.token_ids) if t.token_ids is not None else t.text
                 for t in episode.conversation if t.role == "assistant")


def select_episodes(episodes: list, group_ids: torch.Tensor, eligible: torch.Tensor, *, dedupe: bool = True,
                    max_per_group: int | None = None) -> list[int]:
    """The indices of the episodes to train on, in episode order: the eligible ones, within each group without
    repeats of an earlier kept episode's generated tokens (``dedupe``), at most ``max_per_group`` per group."""
    kept: list[int] = []
    seen: dict[int, set] = {}
    count: dict[int, int] = {}
    for i, episode in enumerate(episodes):
        if not bool(eligible[i]):
            continue
        g = int(group_ids[i])
        if max_per_group is not None and count.get(g, 0) >= max_per_group:
            continue
        if dedupe:
            key = _trace_key(episode)
            if key in seen.setdefault(g, set()):
                continue
            seen[g].add(key)
        count[g] = count.get(g, 0) + 1
        kept.append(i)
    return kept


def mixed_fraction(eligible: torch.Tensor, group_ids: torch.Tensor) -> float:
    """The share of groups with both eligible and ineligible episodes."""
    groups = group_ids.unique()
    mixed = sum(1 for g in groups if 0 < int(eligible[group_ids == g].sum()) < int((group_ids == g).sum()))
    return mixed / max(len(groups), 1)


# ============================================================================ update


def episodes_nll(policy, episodes: list, *, module=None, with_entropy: bool = False):
    """``(nll sum, trained tokens[, entropy sum])`` of ``episodes``' generated tokens: ``-sum(logp * m)``, with the
    loss mask ``m`` of :func:`flowrl.policies.build_inputs` on the trained conversation (the actions), under the
    model at temperature 1. The sum carries gradients unless called under ``torch.no_grad()``."""
    from flowrl.envs.epoch import trained_conversation

    inputs = policy.build_inputs([trained_conversation(e) for e in episodes])
    out = policy.score(inputs, module=module, with_entropy=with_entropy)
    logp, entropy = out if with_entropy else (out, None)
    mask = inputs.loss_mask.to(logp.device)
    nll = -(logp * mask).sum()
    if with_entropy:
        return nll, float(mask.sum()), float((entropy * mask).sum())
    return nll, float(mask.sum())


def train_epoch(policy, module, optimizer, batch, kept: list[int], cfg: Config, dist, epoch: int,
                health=None) -> dict[str, float]:
    """The NLL updates of one epoch on the kept episodes (``kept``: indices into ``batch.episodes``), this
    process's shard of each minibatch; each minibatch's loss is normalised by its global token count."""
    from flowrl.envs.epoch import micro_batches, minibatch_plan, shard
    from flowrl.envs.rollout import sample_seed
    from flowrl.run.updates import optimizer_step

    t = cfg.train
    episodes = [batch.episodes[i] for i in kept]
    plans = minibatch_plan(len(episodes), t.inner_epochs, t.minibatches,
                           random.Random(sample_seed(cfg.run.seed, epoch, 7)))
    params = policy.trainable_parameters()
    nll_sum = entropy_sum = tokens = grad_sum = 0.0
    steps = 0
    for minibatch in plans:
        n_tok = max(float(sum(sum(episodes[i].action_lengths) for i in minibatch)), 1.0)  # every process knows it
        micros = micro_batches(shard(minibatch, dist), t.micro_batch_size)
        optimizer.zero_grad(set_to_none=True)
        for j, micro in enumerate(micros):
            nll, count, entropy = episodes_nll(policy, [episodes[i] for i in micro], module=module, with_entropy=True)
            # DDP averages gradients over processes; the loss is already normalised globally, so undo it.
            dist.backward(nll / n_tok * dist.world_size, module, sync=j == len(micros) - 1)
            nll_sum += float(nll.detach())
            entropy_sum += entropy
            tokens += count
        grad_sum += optimizer_step(optimizer, params, dist, grad_clip=cfg.optim.grad_clip, health=health)
        steps += 1
    sums = torch.tensor([nll_sum, entropy_sum, tokens], dtype=torch.float64)
    if dist.world_size > 1:
        sums = dist.gather(sums[None]).sum(0)
    return {"train/nll": float(sums[0] / sums[2].clamp(min=1)), "train/entropy": float(sums[1] / sums[2].clamp(min=1)),
            "train/grad_norm": grad_sum / max(steps, 1), "train/optimizer_steps": steps,
            "train/lr": optimizer.param_groups[0]["lr"]}


# ============================================================================ run


def main(cfg: Config, *, policy=None, dist=None) -> int:
    """Run online rejection-sampling fine-tuning. ``policy`` / ``dist`` may be injected (tests)."""
    from flowrl.config import to_dict
    from flowrl.envs.epoch import collect_epoch, epoch_metrics
    from flowrl.run.harness import Run

    short = cfg.env.name.removeprefix("shapes_")
    run = Run(cfg.run, "vlm_rft", schedule=cfg.eval, log=cfg.log, checkpoint=cfg.checkpoint, precision=None,
              reward=f"{cfg.train.correct} = 1" + (" and consistent" if cfg.train.require_consistent else ""),
              config=to_dict(cfg), dist=dist, counters=("episodes_sampled", "episodes_kept"),
              plots={"reward": ["train/reward_mean", "train/reward/"],
                     "eval": [f"eval/{short}/", f"eval/{short}_heldout/", f"eval/{short}_multi/"],
                     "selection": ["train/correct_frac", "train/eligible_frac", "train/kept_frac", "train/mixed_frac",
                                   "train/mixed_groups/"],
                     "policy": ["train/nll", "train/entropy", "train/rollout_entropy"]},
              units={"reward": "episode reward", "eval": "held-out accuracy", "selection": "fraction",
                     "policy": "nats per trained token"})
    dist = run.dist
    policy, env_spec, answer_rewards, optimizer, scheduler, module = prepare_training(run, cfg, policy)
    variant = VARIANTS["grpo"]  # GRPO's sampling: one round, no overlong penalty

    with run:
        while run.next_epoch():
            start = time.perf_counter()
            batch = collect_epoch(policy, run.epoch, dist, answer_rewards, env_spec, env=cfg.env,
                                  sampling=cfg.sampling, variant=variant, seed=cfg.run.seed)
            right, consistent = selection_scores(batch.episodes, cfg.train.correct, reward_spec=cfg.reward.answer,
                                                 require_consistent=cfg.train.require_consistent)
            eligible = right & consistent
            kept = select_episodes(batch.episodes, batch.group_ids, eligible, dedupe=cfg.train.dedupe,
                                   max_per_group=cfg.train.max_per_group)
            kept = kept[:len(kept) - len(kept) % dist.world_size]  # an equal shard per process
            collected = time.perf_counter()
            n = len(batch.episodes)
            metrics = epoch_metrics(batch, cfg.env.name)
            metrics.update({"train/correct_frac": float(right.float().mean()),
                            "train/eligible_frac": float(eligible.float().mean()),
                            "train/kept_frac": len(kept) / n, "train/mixed_frac": mixed_fraction(eligible,
                                                                                                  batch.group_ids),
                            "train/kept_tokens": float(sum(sum(batch.episodes[i].action_lengths) for i in kept))})
            # To the run's health checks the signal is the selection: an epoch that keeps nothing has none.
            health = {"train/nan_rewards": metrics["train/nan_rewards"], "train/zero_std_frac": 0.0 if kept else 1.0}
            if not kept and dist.is_main:
                print(f"flowrl: warning: epoch {run.epoch + 1}: no episode was right and consistent "
                      "(train/kept_frac = 0): no update", flush=True)
            if run.check_rewards(health, n) and kept:
                with run.updating():
                    metrics.update(train_epoch(policy, module, optimizer, batch, kept, cfg, dist, run.epoch,
                                               health=run.health))
            scheduler.step()
            metrics.update({"time/sampling_s": collected - start, "time/training_s": time.perf_counter() - collected})
            run.end_epoch(metrics, episodes_sampled=int(batch.stats["episodes"]), episodes_kept=len(kept))
    if dist.is_main:
        policy.save_pretrained(run.output_dir / "model")
    return run.finish()


RECIPE = Recipe(Config, main)
