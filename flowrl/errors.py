"""The errors flowrl reports to a user as one line (``flowrl <cmd>: error: <cause>; <fix>``), never as a
traceback: a mistake in a config, a missing weight or checkpoint, a failing reward, a bad prompt file, a device that
cannot be used, or a training run stopped by one of those (after saving a checkpoint).

Every such error subclasses :class:`FlowrlError` (and the builtin it is closest to, so ``except ValueError`` keeps
working); commands catch ``FlowrlError`` alone, so a new error type needs no list kept in sync. This module imports
nothing, so every package (``rewards`` included) can subclass it."""

from __future__ import annotations

__all__ = ["FlowrlError", "RunError", "user_errors"]


class FlowrlError(Exception):
    """An error whose message names the cause and the fix in one line: shown to the user as it is."""


class RunError(FlowrlError, RuntimeError):
    """A training run stopped: a user's mistake, its environment, an unhealthy run (non-finite updates,
    degenerate rewards) or an internal error. The message is one line and says where the last checkpoint is
    and how to resume; ``exit_code`` is 2 for the first kinds and 1 for an internal error (whose traceback is
    in the run's ``error.log``)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message is shown as one line: :class:`FlowrlError`."""
    return (FlowrlError,)
