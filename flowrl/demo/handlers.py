"""The demo's handler guard: a visitor's mistake becomes one line in the page, never a traceback; a bug becomes
one line in the page and the traceback in the server's console (the Gradio tabs and the Agent tab share it)."""

from __future__ import annotations

import functools
import logging

from flowrl.demo.limits import public_text

__all__ = ["guarded", "one_line"]

log = logging.getLogger("flowrl.demo")


def _user_errors() -> tuple[type[BaseException], ...]:
    from flowrl.errors import FlowrlError

    return (FlowrlError,)


def one_line(err: BaseException) -> str:
    return public_text(" ".join(str(err).split())) or type(err).__name__


def guarded(fn):
    """Run a handler; mistakes become ``gr.Error`` with a one-line message and no traceback in the page."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import gradio as gr
        import torch

        try:
            return fn(*args, **kwargs)
        except gr.Error:
            raise
        except _user_errors() as err:
            raise gr.Error(one_line(err), print_exception=False) from None
        except torch.cuda.OutOfMemoryError:
            raise gr.Error("out of GPU memory: ask for fewer models, prompts, seeds or steps",
                           print_exception=False) from None
        except Exception as err:  # a bug: the page gets one line, the console the traceback
            log.exception("demo handler %s failed", fn.__name__)
            raise gr.Error(f"internal error ({type(err).__name__}); the server's console has the details",
                           print_exception=False) from None

    return wrapper
