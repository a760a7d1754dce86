"""Classifier-free guidance as one wrapper around a velocity function (docs/algorithms.md, section 1).

``classifier_free_guidance(velocity_fn, uncond, scale)`` returns a velocity function with the same
contract, ``(x, sigma, cond) -> v``, so rollout and the training pass use guidance the same way.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

__all__ = ["classifier_free_guidance", "concat_cond", "expand_cond", "select_cond", "cond_batch_size"]

VelocityFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


def cond_batch_size(cond: Any) -> int | None:
    """Batch size of a tensor or dict-of-tensors condition (None for None)."""
    if cond is None:
        return None
    if isinstance(cond, torch.Tensor):
        return cond.shape[0]
    if isinstance(cond, Mapping):
        sizes = {k: v.shape[0] for k, v in cond.items() if isinstance(v, torch.Tensor)}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"condition tensors disagree on the batch size: {sizes}")
        return next(iter(sizes.values()), None)
    raise TypeError(f"a condition must be a tensor, a dict of tensors or None, got {type(cond).__name__}")


def expand_cond(cond: Any, batch: int, name: str = "uncond") -> Any:
    """Broadcast a batch-1 condition (tensor or dict of tensors) to ``batch`` rows; batch-``batch`` passes."""
    if cond is None:
        return None
    if isinstance(cond, torch.Tensor):
        if cond.shape[0] == batch:
            return cond
        if cond.shape[0] == 1:
            return cond.expand((batch,) + tuple(cond.shape[1:]))
        raise ValueError(f"{name} has batch {cond.shape[0]}; expected 1 or {batch}")
    if isinstance(cond, Mapping):
        return {k: expand_cond(v, batch, f"{name}[{k!r}]") if isinstance(v, torch.Tensor) else v
                for k, v in cond.items()}
    raise TypeError(f"{name} must be a tensor, a dict of tensors or None, got {type(cond).__name__}")


def concat_cond(first: Any, second: Any) -> Any:
    """Concatenate two conditions of the same structure along the batch dimension."""
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        if first.shape[1:] != second.shape[1:]:
            raise ValueError(
                f"cond and uncond shapes differ beyond the batch: {tuple(first.shape)} vs {tuple(second.shape)} "
                "(pad them to the same sequence length)"
            )
        return torch.cat([first, second], dim=0)
    if isinstance(first, Mapping) and isinstance(second, Mapping):
        if set(first) != set(second):
            raise ValueError(f"cond and uncond have different keys: {sorted(first)} vs {sorted(second)}")
        out = {}
        for k in first:
            a, b = first[k], second[k]
            if isinstance(a, torch.Tensor):
                out[k] = concat_cond(a, b)
            else:  # non-tensor entries (flags, sizes) must agree
                if a != b:
                    raise ValueError(f"non-tensor condition entry {k!r} differs between cond and uncond: "
                                     f"{a!r} vs {b!r}")
                out[k] = a
        return out
    raise TypeError(
        f"cond and uncond must both be tensors or both dicts of tensors, got {type(first).__name__} and "
        f"{type(second).__name__}"
    )


def select_cond(cond: Any, rows: torch.Tensor) -> Any:
    """Rows ``rows`` (a long index or bool mask) of a tensor / dict-of-tensors condition."""
    if cond is None:
        return None
    if isinstance(cond, torch.Tensor):
        return cond[rows.to(cond.device)]
    if isinstance(cond, Mapping):
        return {k: select_cond(v, rows) if isinstance(v, torch.Tensor) else v for k, v in cond.items()}
    raise TypeError(f"a condition must be a tensor, a dict of tensors or None, got {type(cond).__name__}")


def classifier_free_guidance(velocity_fn: VelocityFn, uncond: Any, scale: float | torch.Tensor, *,
                             detach_uncond: bool = False) -> VelocityFn:
    """Wrap ``velocity_fn`` with classifier-free guidance ``v = v_u + w (v_c - v_u)``.

    The guided function runs the conditional and unconditional branches in ONE batched call
    (``x``, ``sigma`` and the conditions concatenated along the batch, unconditional first). With
    ``scale == 1`` it makes exactly one un-doubled conditional call.

    Args:
        velocity_fn: ``(x [B, ...], sigma [B], cond) -> v [B, ...]``.
        uncond: the unconditional (empty-prompt) condition: a tensor or dict of tensors with batch 1
            (broadcast to ``B``) or ``B``.
        scale: guidance weight ``w`` (float, or a ``[B]`` tensor for per-sample weights).
        detach_uncond: stop gradients through the unconditional branch: the guided velocity's gradient
            is then ``w dv_c`` only. Flow-GRPO trains this way; with the default both branches
            back-propagate (``(1 - w) dv_u + w dv_c``). Values are identical either way.

    Returns:
        ``guided(x, sigma, cond) -> v``. With ``w != 1`` the combination is computed in float32 and
        returned as float32 (the steps compute in float32 anyway); with ``w == 1`` it returns the
        model's output unchanged.
    """
    per_sample = isinstance(scale, torch.Tensor) and scale.ndim > 0
    # One weight for the batch is a Python float, read once here: ``v_u + w (v_c - v_u)`` with a float needs no
    # tensor for ``w``, where a 0-d tensor built per call on the device would be a host-to-device copy per model
    # call (per denoising step). The float is rounded to float32 in the product just as the 0-d float32 tensor was.
    weight = None if per_sample else float(scale)
    if not per_sample and weight == 1.0:

        def conditional_only(x: torch.Tensor, sigma: torch.Tensor, cond: Any) -> torch.Tensor:
            return velocity_fn(x, sigma, cond)

        return conditional_only

    def guided(x: torch.Tensor, sigma: torch.Tensor, cond: Any) -> torch.Tensor:
        if cond is None:
            raise ValueError("classifier-free guidance needs a condition (cond is None)")
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, device=x.device)
        if sigma.ndim == 0:
            sigma = sigma.expand(b)
        cond_b = cond_batch_size(cond)
        if cond_b is not None and cond_b != b:
            raise ValueError(f"cond has batch {cond_b}, x has batch {b}")
        both = concat_cond(expand_cond(uncond, b), cond)
        v = velocity_fn(torch.cat([x, x], dim=0), torch.cat([sigma, sigma], dim=0), both)
        v_u, v_c = v.float().chunk(2, dim=0)
        if detach_uncond:
            v_u = v_u.detach()
        if weight is not None:
            return v_u + weight * (v_c - v_u)
        w = scale.to(device=v.device, dtype=torch.float32).reshape((b,) + (1,) * (v_c.ndim - 1))
        return v_u + w * (v_c - v_u)

    return guided
