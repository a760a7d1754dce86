"""The errors flowrl reports to a user as one line (``flowrl <cmd>: error: <cause>; <fix>``), never as a
traceback: a mistake in a config, a missing weight or checkpoint, a failing reward, a bad prompt file, or
a training run stopped by one of those (after saving a checkpoint)."""

from __future__ import annotations

__all__ = ["RunError", "user_errors"]


class RunError(RuntimeError):
    """A training run stopped because of a user's mistake or environment (the message says where the last
    checkpoint is and how to resume)."""


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message is shown as one line."""
    from flowrl.checkpoint import CheckpointError
    from flowrl.config import ConfigError
    from flowrl.data.prompts import PromptSetError
    from flowrl.models.base import ModelLoadError
    from rewards.base import RewardError

    return (ConfigError, CheckpointError, ModelLoadError, RewardError, PromptSetError, RunError)
