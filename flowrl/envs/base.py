"""The environment interface of multi-turn agents.

An environment plays one episode at a time::

    observation = env.reset(task)                    # the first user turn (text and images)
    observation, reward, done = env.step(action_text)  # the policy's turn in, the environment's answer out

Observations may carry images. The episode's reward is the sum of the step rewards; an environment
returns ``done=True`` when the episode is over (an answer was given, or it gave up). Environments are
plain Python: no tokens, no tensors. :mod:`flowrl.envs.rollout` plays many episodes in lock-step with a
:class:`flowrl.policies.TokenPolicy`, enforcing the turn limit and counting errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Observation", "StepResult", "Environment", "Task"]


@dataclass
class Observation:
    """What the policy sees next.

    Attributes:
        text: the turn's text; ``{image}`` marks where each image goes (else images come first).
        images: ``[H, W, 3]`` uint8 arrays.
        role: ``user`` for the first turn, ``tool`` for a tool's result or an error message.
        anchor: a hashable key of the environment state this observation shows, for GiGPO's anchor-state
            grouping (steps of one task group whose anchors are equal were taken from the same state).
    """

    text: str
    images: list[Any] = field(default_factory=list)
    role: str = "user"
    anchor: Any = None


@dataclass
class StepResult:
    """The environment's answer to one action.

    Attributes:
        observation: the next turn (None when ``done``).
        reward: this step's reward.
        done: the episode is over.
        info: counters and facts for logging (e.g. ``{"tool_call": 1}``, ``{"malformed": 1}``, ``{"correct": 1}``).
    """

    observation: Observation | None
    reward: float
    done: bool
    info: dict[str, float] = field(default_factory=dict)


@dataclass
class Task:
    """One task instance: the question, its canonical answer, its kind and whatever the environment needs.

    ``group`` names the task group (GRPO groups episodes of the same task); ``data`` is environment-specific.
    """

    question: str
    answer: str
    kind: str
    data: Any = None
    group: Any = None


class Environment(Protocol):
    """A multi-turn environment (see the module docstring)."""

    def reset(self, task: Task) -> Observation: ...

    def step(self, action_text: str) -> StepResult: ...
