"""The errors flowrl reports to a user as one line (``flowrl <cmd>: error: <cause>; <fix>``), never as a
traceback: a mistake in a config, a missing weight or checkpoint, a failing reward, a bad prompt file, or
a training run stopped by one of those (after saving a checkpoint)."""

from __future__ import annotations

__all__ = ["RunError", "user_errors"]


class RunError(RuntimeError):
    """A training run stopped: a user's mistake, its environment, an unhealthy run (non-finite updates,
    degenerate rewards) or an internal error. The message is one line and says where the last checkpoint is
    and how to resume; ``exit_code`` is 2 for the first kinds and 1 for an internal error (whose traceback is
    in the run's ``error.log``)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message is shown as one line."""
    from flowrl.checkpoint import CheckpointError
    from flowrl.config import ConfigError
    from flowrl.data.prompts import PromptSetError
    from flowrl.hardware import DeviceError
    from flowrl.models.base import ModelLoadError
    from rewards.base import RewardError

    return (ConfigError, CheckpointError, ModelLoadError, RewardError, PromptSetError, RunError, DeviceError)
