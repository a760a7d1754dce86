"""Play episodes of an environment with a token policy, several turns each, in lock-step batches.

Every round, the policy samples the next action of every unfinished episode in one batched call; each
environment answers; the action's token ids (verbatim) and the environment's observation are appended to
the conversation. An episode ends when the environment says so or when it reaches ``max_turns`` actions
(then it gets no answer reward and is counted as ``turn_limit``).

What can go wrong is handled and counted, never raised: a malformed tool call gets an error turn from the
environment (``malformed``); an empty generation is an empty answer (``empty``); an action cut at
``max_new_tokens`` is kept as it is (``truncated``) and parsed like any other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .base import Task

__all__ = ["Episode", "play_episodes", "sample_seed", "SamplingSettings"]


@dataclass
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_strings: tuple[str, ...] = ()
    greedy: bool = False
    batch_size: int = 64
    share_prompts: bool = False  # encode identical prompts (a group's first turn) once: TokenPolicy.generate


@dataclass
class Episode:
    """One played episode.

    Attributes:
        task: the task.
        conversation: the turns (``flowrl.policies.Turn``), assistant turns with their sampled token ids.
        logprobs: per action, ``[n_tokens]`` rollout log-probs.
        turn_rewards: per action, the environment's reward for it (the answer reward is added to the last
            one by the recipe).
        anchors: per action, the anchor key of the state the action was taken in (GiGPO).
        answer: the final answer text ("" if the episode never answered).
        final_text: the whole final turn (reasoning trace, answer tags): what answer rewards read.
        counts: ``truncated``, ``empty``, ``malformed``, ``tool_call``, ``turn_limit`` for this episode.
        index: the global index of the episode in its epoch (its seeds derive from it).
    """

    task: Task
    conversation: list
    logprobs: list[torch.Tensor] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    anchors: list[Any] = field(default_factory=list)
    answer: str = ""
    final_text: str = ""
    answered: bool = False
    counts: dict[str, float] = field(default_factory=dict)
    index: int = 0
    image: Any = None

    @property
    def num_turns(self) -> int:
        return len(self.turn_rewards)

    @property
    def action_lengths(self) -> list[int]:
        return [len(t.token_ids) for t in self.conversation if t.role == "assistant"]


def sample_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, epoch, round, sample index, turn): independent of the process."""
    digest = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def play_episodes(policy, make_env: Callable[[], Any], tasks: list[Task], indices: list[int], *, seed: int,
                  sampling: SamplingSettings, max_turns: int = 1, system_prompt: str | None = None) -> list[Episode]:
    """Play one episode per task.

    Args:
        policy: a :class:`flowrl.policies.TokenPolicy`.
        make_env: builds a fresh environment (one per episode).
        tasks: the tasks.
        indices: the global index of each episode (per-sample seeds are ``sample_seed(seed, index, turn)``).
        seed: the run's seed for this epoch and round (combine the run seed, epoch and round into it).
        sampling: temperature, top-p, max tokens, stop strings, batching.
        max_turns: actions allowed per episode.
        system_prompt: an optional system turn before the environment's first observation (e.g. the R1
            answer format).

    Returns:
        The episodes, in the order of ``tasks``.
    """
    from flowrl.policies.inputs import Turn

    envs = [make_env() for _ in tasks]
    episodes = []
    for task, env, index in zip(tasks, envs, indices):
        obs = env.reset(task)
        first = [Turn("system", system_prompt)] if system_prompt else []
        ep = Episode(task, first + [Turn(obs.role, obs.text, list(obs.images))], index=index,
                     counts=dict.fromkeys(("truncated", "empty", "malformed", "tool_call", "turn_limit"), 0.0))
        ep.anchors.append(obs.anchor)
        ep.image = env.image(task) if hasattr(env, "image") else None
        episodes.append(ep)
    active = list(range(len(episodes)))
    for turn in range(max_turns):
        if not active:
            break
        generations = policy.generate([episodes[i].conversation for i in active],
                                      seeds=[sample_seed(seed, episodes[i].index, turn) for i in active],
                                      temperature=sampling.temperature, top_p=sampling.top_p,
                                      max_new_tokens=sampling.max_new_tokens, stop_strings=sampling.stop_strings,
                                      greedy=sampling.greedy, batch_size=sampling.batch_size,
                                      share_prompts=sampling.share_prompts)
        still = []
        for i, gen in zip(active, generations):
            ep, env = episodes[i], envs[i]
            ep.conversation.append(Turn("assistant", gen.text, token_ids=list(gen.token_ids)))
            ep.logprobs.append(gen.logprobs)
            if gen.finish == "length":
                ep.counts["truncated"] += 1
            if not gen.text.strip():
                ep.counts["empty"] += 1
            result = env.step(gen.text)
            for key in ("malformed", "tool_call"):
                ep.counts[key] += float(result.info.get(key, 0.0))
            ep.turn_rewards.append(float(result.reward))
            if result.done:
                ep.answer, ep.final_text, ep.answered = result.info.get("answer", ""), gen.text, True
                continue
            if turn == max_turns - 1:
                ep.counts["turn_limit"] += 1
                continue
            obs = result.observation
            ep.conversation.append(Turn(obs.role, obs.text, list(obs.images)))
            ep.anchors.append(obs.anchor)
            still.append(i)
        active = still
    return episodes
