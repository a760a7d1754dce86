"""The demo's computations on tensors: sampling, scoring and trajectory analysis (no Gradio here).

Every sample's noise depends only on its seed (``samplers.initial_noise`` / ``step_noise`` with the seed as
the per-sample seed), so a seed gives every model the same initial noise and, for the SDE samplers, the same
noise at every step: the columns of the Compare grid are like for like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from flowrl.demo.limits import DemoInputError, Limits

__all__ = ["RewardSet", "parse_reward_spec", "sample_images", "CompareResult", "compare",
           "TrajectoryResult", "trajectory", "ScoreResult", "score_files", "format_score", "is_video", "is_editing",
           "open_source", "source_for", "check_comparison"]

Tick = Callable[[int], None]


# ============================================================================ rewards


def parse_reward_spec(spec: str) -> tuple[str, dict]:
    """``NAME`` or ``NAME:key=value[,key=value]`` (values read as YAML scalars) -> ``(name, kwargs)``.

    Example: ``remote:url=http://127.0.0.1:8000,name=pickscore``.
    """
    import yaml

    name, _, rest = spec.partition(":")
    kwargs = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise DemoInputError(f"bad reward {spec!r}: write NAME or NAME:key=value[,key=value]")
        try:
            kwargs[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            kwargs[key.strip()] = value
    return name.strip(), kwargs


class RewardSet:
    """The rewards the demo scores with: those that loaded, and for the others the reason they did not.

    Attributes:
        loaded: name -> reward, in the order given.
        failed: name -> one-line reason (missing weights, unknown name, bad arguments).
    """

    def __init__(self, loaded: dict | None = None, failed: dict[str, str] | None = None):
        self.loaded = dict(loaded or {})
        self.failed = dict(failed or {})

    @classmethod
    def load(cls, specs: Sequence[str], *, log: Callable[[str], None] | None = None) -> "RewardSet":
        """Try to load each reward spec (see :func:`parse_reward_spec`); never raises for a reward that
        does not load, it is listed in ``failed`` with the reason."""
        import rewards
        from flowrl.registry import UnknownNameError

        out = cls()
        for spec in specs:
            name = spec.partition(":")[0].strip()
            try:
                name, kwargs = parse_reward_spec(spec)
                out.loaded[name] = rewards.load(name, **kwargs)
            except UnknownNameError as err:
                out.failed[name] = err.message
            except (rewards.RewardError, DemoInputError, TypeError, ValueError, OSError, ImportError) as err:
                out.failed[name] = " ".join(str(err).split()) or type(err).__name__
            if name in out.failed and log is not None:
                log(f"reward {name!r} is not available: {out.failed[name]}")
        return out

    @property
    def names(self) -> list[str]:
        return list(self.loaded)

    def select(self, names: Sequence[str] | None) -> list[str]:
        """Check a selection of reward names (None or empty: every loaded reward)."""
        if not names:
            return self.names
        if isinstance(names, str):
            names = [names]
        for name in names:
            if name not in self.loaded:
                why = f" ({self.failed[name]})" if name in self.failed else ""
                raise DemoInputError(f"reward {name!r} is not loaded{why}; loaded: {', '.join(self.loaded) or 'none'}")
        return list(dict.fromkeys(names))

    def score(self, images: torch.Tensor, prompts: list[str], names: Sequence[str],
              metadata: list[dict] | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Score ``images [B, 3, H, W]`` (or videos ``[B, F, 3, H, W]``: an image reward scores every frame) with
        each named reward; ``metadata`` (one row per image, e.g. an edit's ``source_image``) reaches rewards
        that read it.

        Returns:
            ``(columns, warnings)``: ``columns`` maps each reward name to ``[B]`` scores (NaN where it
            failed) and, where the reward reports it, ``"<name> correct"`` to its 0/1 accuracy flags;
            ``warnings`` says which rewards failed and why (one line each).
        """
        from rewards import RewardError

        columns: dict[str, torch.Tensor] = {}
        warnings: list[str] = []
        for name in names:
            try:
                reward = self.loaded[name]
                out = reward(images, prompts) if metadata is None else reward(images, prompts, metadata)
            except RewardError as err:
                warnings.append(" ".join(str(err).split()))
                columns[name] = torch.full((len(prompts),), math.nan)
                continue
            except Exception as err:  # a reward model crashing on an odd input: say so, keep the images
                warnings.append(f"{name} failed: {type(err).__name__}: {' '.join(str(err).split())}")
                columns[name] = torch.full((len(prompts),), math.nan)
                continue
            columns[name] = out.scores.detach().float().cpu()
            if "correct" in out.details:
                columns[f"{name} correct"] = out.details["correct"].detach().float().cpu()
            if not torch.isfinite(columns[name]).all():
                warnings.append(f"{name} returned NaN for some images (shown as n/a)")
        return columns, warnings


def format_score(value: float, digits: int = 3) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.{digits}f}"


# ============================================================================ sampling


def _expand(cond: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    return {k: v.expand((n,) + tuple(v.shape[1:])) for k, v in cond.items()}


@torch.no_grad()
def _rollout(model, prompts: list[str], seeds: list[int], *, steps: int, guidance: float | None, sampler: str,
             noise_level: float | None, store_x0: bool = False, tick: Tick | None = None,
             metadata: list[dict] | None = None):
    """One rollout of ``len(prompts)`` samples (``metadata``: one row per prompt, an editing model's
    ``source_image``); returns ``(trajectory, cond, velocity_fn)``."""
    from samplers import initial_noise, noise_kwargs, rollout

    from flowrl.models.base import encode_rows

    velocity = model.velocity_fn(guidance)

    def counted(x, sigma, cond):
        v = velocity(x, sigma, cond)
        if tick is not None:
            tick(1)
        return v

    cond = encode_rows(model, prompts, metadata)  # an editing model reads each row's source_image
    seeds_t = torch.as_tensor(seeds, dtype=torch.int64)
    x = initial_noise(model.latent_shape, seeds_t, device=model.device)
    traj = rollout(counted, x, model.sigmas(steps), cond=cond, step=sampler,
                   step_kwargs=noise_kwargs(sampler, noise_level), sample_seeds=seeds_t, store_x0=store_x0,
                   model_dtype=model.dtype)
    return traj, cond, velocity


def sample_images(model, prompts: list[str], seeds: list[int], *, steps: int, guidance: float | None = None,
                  sampler: str = "ode", noise_level: float | None = None, batch_size: int = 16,
                  tick: Tick | None = None, metadata: list[dict] | None = None) -> torch.Tensor:
    """Images ``[B, 3, H, W]`` in [0, 1] (CPU), one per ``(prompts[b], seeds[b])``; a video model's clips
    ``[B, F, 3, H, W]``.

    ``tick(1)`` is called after every model call (``steps`` per batch of ``batch_size``), for progress bars.
    ``metadata``: one row per prompt; an editing model edits each row's ``source_image`` ``[3, H, W]``.
    """
    out = []
    for start in range(0, len(prompts), batch_size):
        rows = None if metadata is None else metadata[start:start + batch_size]
        traj, _, _ = _rollout(model, prompts[start:start + batch_size], seeds[start:start + batch_size],
                              steps=steps, guidance=guidance, sampler=sampler, noise_level=noise_level, tick=tick,
                              metadata=rows)
        out.append(model.decode(traj.x0).float().cpu())
    return torch.cat(out)


# ============================================================================ video and editing models


def is_video(model) -> bool:
    """A video model (``model.num_frames``: Wan): its samples are clips ``[F, 3, H, W]``."""
    return getattr(model, "num_frames", None) is not None


def is_editing(model) -> bool:
    """An editing model (FLUX.1-Kontext): it edits a source image beside each prompt."""
    return bool(getattr(model, "conditions_on_source", False))


def open_source(path: str | Path, limits: Limits):
    """The uploaded source image of an edit, as an RGB PIL image: PNG, JPEG or WebP only (decoded through
    :func:`flowrl.untrusted.open_image`), at most ``limits.max_upload_mb`` MB and ``limits.max_image_side`` px.

    Raises:
        DemoInputError: not such an image, or too large (the message says what is allowed).
    """
    return _open_image(path, limits)


def source_for(model, image) -> torch.Tensor:
    """``image`` (RGB PIL) at ``model``'s image size as ``[3, H, W]`` float32 in [0, 1]: the source an editing
    model edits and the grid's first column (bicubic, as ``flowrl sample --source``)."""
    import numpy as np
    from PIL import Image

    height, width = (side * model.vae_scale_factor for side in model.latent_shape[-2:])
    resized = image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
    return torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def check_comparison(models: dict, source) -> None:
    """Refuse a comparison whose rows cannot sit in one grid, with the reason and the fix.

    - Editing models edit the source; text-to-image / text-to-video models draw from the prompt alone. Their
      outputs answer different questions (and the source column would belong to some rows only), so they are
      compared separately: a mix is refused, naming which is which.
    - An editing model needs a source; a source given to non-editing models only is refused (naming them), so
      that a visitor never believes a model saw an image it ignored.
    - Video and image models are not mixed either (frame strips and images of one grid, drift between a clip and
      an image: not like for like).

    Raises:
        DemoInputError.
    """
    editing = [name for name, model in models.items() if is_editing(model)]
    others = [name for name in models if name not in editing]
    if editing and others:
        raise DemoInputError(f"{', '.join(editing)} edit(s) a source image and {', '.join(others)} draw(s) from the "
                             "prompt alone: compare editing models and text-to-image models separately (select "
                             "either kind only)")
    if editing and source is None:
        raise DemoInputError(f"{', '.join(editing)} edit(s) a source image: upload one under 'Source image'")
    if source is not None and not editing:
        raise DemoInputError(f"a source image was given but {', '.join(others)} do(es) not edit images (no "
                             "editing model selected, e.g. FLUX.1-Kontext): remove the source, or select editing "
                             "models")
    videos = [name for name, model in models.items() if is_video(model)]
    images = [name for name in models if name not in videos]
    if videos and images:
        raise DemoInputError(f"{', '.join(videos)} make(s) videos and {', '.join(images)} image(s): compare video "
                             "models and image models separately")


# ============================================================================ Compare


@dataclass
class CompareResult:
    """Generations of several models on the same prompts and seeds.

    ``images[m]`` is ``[P * S, 3, H, W]`` in prompt-major order (prompt ``p``, seed ``s`` at ``p * S + s``),
    a video model's ``[P * S, F, 3, H, W]``; ``scores[m]`` maps each reward column to ``[P * S]``. For editing
    models ``sources[m]`` is the source ``[3, H, W]`` at that model's image size (what it edited).
    """

    models: list[str]
    prompts: list[str]
    seeds: list[int]
    images: dict[str, torch.Tensor]
    scores: dict[str, dict[str, torch.Tensor]]
    columns: list[str]
    warnings: list[str] = field(default_factory=list)
    sources: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def videos(self) -> bool:
        """Whether the samples are clips ``[F, 3, H, W]``."""
        return any(v.dim() == 5 for v in self.images.values())

    def mean_rows(self) -> list[list]:
        """``[model, mean of each column...]`` (NaN-aware: n/a only when every score failed)."""
        rows = []
        for m in self.models:
            row: list = [m]
            for c in self.columns:
                values = self.scores[m][c]
                finite = values[torch.isfinite(values)]
                row.append(round(float(finite.mean()), 4) if finite.numel() else None)
            rows.append(row)
        return rows

    def sample_rows(self) -> list[list]:
        """``[model, prompt, seed, score of each column...]`` for every image."""
        rows = []
        for m in self.models:
            for p, prompt in enumerate(self.prompts):
                for s, seed in enumerate(self.seeds):
                    i = p * len(self.seeds) + s
                    values = [float(self.scores[m][c][i]) for c in self.columns]
                    rows.append([m, prompt, seed] + [round(v, 4) if math.isfinite(v) else None for v in values])
        return rows

    def caption(self, model: str, index: int) -> str:
        """The reward lines drawn under one image: ``name value`` per reward (long names shortened), with
        ``correct`` / ``wrong`` appended where the reward reports all-constraints-met flags."""
        lines = []
        for c in self.columns:
            if c.endswith(" correct") and c[: -len(" correct")] in self.columns:
                continue  # shown on its reward's line
            value = float(self.scores[model][c][index])
            name = c if len(c) <= 12 else c[:11] + "."
            line = f"{name} {format_score(value, 2)}"
            flag = self.scores[model].get(f"{c} correct")
            if flag is not None and math.isfinite(float(flag[index])):
                line += " correct" if float(flag[index]) >= 0.5 else " wrong"
            lines.append(line)
        return "\n".join(lines)


def compare(models: dict, prompts: list[str], seeds: list[int], *, steps: int, guidance: float | None,
            sampler: str, noise_level: float | None, rewards: RewardSet, reward_names: Sequence[str],
            tick: Tick | None = None, on_model: Callable[[str], None] | None = None, source=None) -> CompareResult:
    """Generate every (prompt, seed) with every model and score the images (or clips).

    Args:
        models: name -> model, in row order.
        prompts / seeds: the grid's prompts and its columns.
        steps / guidance / sampler / noise_level: the sampling settings, the same for every model.
        rewards / reward_names: the rewards to score with (per frame for videos: rewards/ scores clips).
        tick: called with 1 after every model call; on_model: called with each model's name before it samples.
        source: editing models: the source image (RGB PIL, any size; :func:`open_source`) every prompt edits,
            resized to each model's image size (:func:`source_for`); the rewards see it as ``source_image``.

    Raises:
        DemoInputError: a mix :func:`check_comparison` refuses (editing with other models, a missing or
            unneeded source, videos with images).
    """
    check_comparison(models, source)
    flat_prompts = [p for p in prompts for _ in seeds]
    flat_seeds = [s for _ in prompts for s in seeds]
    images: dict[str, torch.Tensor] = {}
    scores: dict[str, dict[str, torch.Tensor]] = {}
    sources: dict[str, torch.Tensor] = {}
    warnings: list[str] = []
    columns: list[str] = []
    for name, model in models.items():
        if on_model is not None:
            on_model(name)
        metadata = None
        if source is not None:
            sources[name] = source_for(model, source)
            metadata = [{"source_image": sources[name]} for _ in flat_prompts]
        images[name] = sample_images(model, flat_prompts, flat_seeds, steps=steps, guidance=guidance,
                                     sampler=sampler, noise_level=noise_level, tick=tick, metadata=metadata)
        scores[name], found = rewards.score(images[name], flat_prompts, reward_names, metadata)
        warnings += [w for w in found if w not in warnings]
        columns += [c for c in scores[name] if c not in columns]
    for name in models:  # every model has every column (a reward may have failed for one model only)
        for c in columns:
            scores[name].setdefault(c, torch.full((len(flat_prompts),), math.nan))
    return CompareResult(list(models), list(prompts), list(seeds), images, scores, columns, warnings, sources)


# ============================================================================ Trajectory


@dataclass
class TrajectoryResult:
    """One sample's trajectory: ``T`` steps, of which ``n`` are SDE steps (``n = 0`` for the ODE sampler).

    Attributes:
        sigmas: ``[T + 1]`` the schedule.
        sde: ``[T]`` bool, the steps that drew noise.
        x0_images: ``[T, 3, H, W]`` the predicted clean image at the state each step starts from
            (``x - sigma v``, decoded), in [0, 1].
        final: ``[3, H, W]`` the sample.
        reward_name: the reward of the curve (None: no reward curve).
        R: ``[n + 1]`` ``R_0 .. R_n`` (docs/algorithms.md, section 4): ``R_0`` the reward of the pure ODE rollout
            from the same noise, ``R_t`` that of the ODE completion from the state after SDE step ``t``, ``R_n`` the
            sample's own reward. For the ODE sampler ``[1]``, the sample's reward.
        step_rewards / turning: ``[n]`` TP-GRPO step rewards and turning-point flags.
        rho: ``[T]`` cosine-credit reward-to-go weights (``rho_1 = 1``); weights: ``[T]`` the per-step
            weights ``w_t = rho_t - rho_{t+1}`` (they sum to 1).
        extra_nfe: model evaluations spent on the ODE completions.
    """

    prompt: str
    seed: int
    sampler: str
    sigmas: torch.Tensor
    sde: torch.Tensor
    x0_images: torch.Tensor
    final: torch.Tensor
    reward_name: str | None = None
    R: torch.Tensor | None = None
    step_rewards: torch.Tensor | None = None
    turning: torch.Tensor | None = None
    rho: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    extra_nfe: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    @property
    def num_sde(self) -> int:
        return int(self.sde.sum())

    def table_headers(self) -> list[str]:
        return ["step", "sigma", "sigma_next", "sde", "R_t (ODE-completed)", "d_t", "step reward",
                "turning point", "cosine weight w_t", "rho_t"]

    def table_rows(self) -> list[list]:
        """One row per step ``t = 1..T`` (``R_t``, ``d_t``, step reward and turning point only for SDE steps)."""
        rows = []
        n = self.num_sde
        for t in range(1, self.num_steps + 1):
            r = d = step_reward = None
            tp = None
            if self.R is not None and n and t <= n:
                r = round(float(self.R[t]), 4)
                d = round(float(self.R[t] - self.R[t - 1]), 4)
                if self.step_rewards is not None:
                    step_reward = round(float(self.step_rewards[t - 1]), 4)
                    tp = bool(self.turning[t - 1])
            rows.append([t, round(float(self.sigmas[t - 1]), 4), round(float(self.sigmas[t]), 4), bool(self.sde[t - 1]),
                         r, d, step_reward, tp,
                         None if self.weights is None else round(float(self.weights[t - 1]), 4),
                         None if self.rho is None else round(float(self.rho[t - 1]), 4)])
        return rows


def _credit_module():
    try:
        from flowrl.core import credit
    except ImportError:
        return None
    if not all(hasattr(credit, f) for f in ("turning_point_rewards", "cosine_credit")):
        return None
    return credit


@torch.no_grad()
def trajectory(model, prompt: str, seed: int, *, steps: int, guidance: float | None, sampler: str,
               noise_level: float | None, reward=None, reward_name: str | None = None, cosine_window: int = 1,
               tick: Tick | None = None, completion_batch: int = 64) -> TrajectoryResult:
    """Sample one trajectory and analyse it: predicted clean images, TP-GRPO rewards, cosine credit.

    Image models only: a video or editing model is a DemoInputError (the Compare tab shows them).
    With an SDE sampler every step but the last is an SDE step (``n = T - 1``). The ``n`` ODE completions
    (from the states before SDE steps ``1..n``; the last one is the sample itself) run batched in
    ``samplers.ode_complete``: ``sum_k (T - k)`` extra model evaluations, about ``T^2 / 2``.
    """
    from samplers import ode_complete

    if is_video(model):
        raise DemoInputError("the Trajectory tab is for image models: a video model's trajectory would be a strip "
                             "of clips; compare its clips (frame strips and GIFs) in the Compare tab")
    if is_editing(model):
        raise DemoInputError("the Trajectory tab is for text-to-image models: an editing model needs a source "
                             "image, which only the Compare tab takes; compare its edits there")
    traj, cond, velocity = _rollout(model, [prompt], [seed], steps=steps, guidance=guidance, sampler=sampler,
                                    noise_level=noise_level, store_x0=True, tick=tick)
    x0_images = model.decode(traj.x0_preds[0]).float().cpu()
    final = model.decode(traj.x0).float().cpu()
    result = TrajectoryResult(prompt, seed, sampler, traj.sigmas.clone(), traj.train_mask.clone(), x0_images,
                              final[0], reward_name=reward_name)
    credit = _credit_module()
    if credit is None:
        result.warnings.append("flowrl.core.credit is not available here: no turning points or cosine credit")
    else:
        try:
            rho = credit.cosine_credit(traj.x0_preds.float().cpu(), traj.x0.float().cpu(), window=cosine_window)[0]
        except ValueError as err:
            result.warnings.append(f"cosine credit: {err}")
        else:
            result.rho = rho.float()
            result.weights = rho - torch.cat([rho[1:], rho.new_zeros(1)])
    if reward is None:
        return result
    scored, found = RewardSet({reward_name: reward}).score(final, [prompt], [reward_name])
    result.warnings += found
    n = result.num_sde
    if n == 0:
        result.R = scored[reward_name][:1].clone()
        return result
    starts = list(range(n))  # R_0 .. R_{n-1}: completions from the states before SDE steps 1..n
    x = traj.latents[0, starts]

    def counted(x_rows, sigma, c):
        v = velocity(x_rows, sigma, c)
        if tick is not None:
            tick(1)
        return v

    x0, nfe = ode_complete(counted, x, traj.sigmas, starts, cond=_expand(cond, n), model_dtype=model.dtype,
                           max_batch=completion_batch)
    result.extra_nfe = int(nfe)
    completed, found = RewardSet({reward_name: reward}).score(model.decode(x0).float().cpu(), [prompt] * n,
                                                              [reward_name])
    result.warnings += [w for w in found if w not in result.warnings]
    R = torch.cat([completed[reward_name], scored[reward_name][:1]])
    result.R = R
    if credit is not None and bool(torch.isfinite(R).all()):
        step_rewards, turning = credit.turning_point_rewards(R[None, 1:], R[None, 0])
        result.step_rewards, result.turning = step_rewards[0].float(), turning[0].bool()
    elif credit is not None:
        result.warnings.append("the reward is NaN somewhere along the trajectory: no turning points")
    return result


# ============================================================================ Score


@dataclass
class ScoreResult:
    """Scores of uploaded images: ``columns[c]`` is ``[N]`` in upload order."""

    files: list[str]
    prompts: list[str]
    sizes: list[tuple[int, int]]
    columns: dict[str, torch.Tensor]
    warnings: list[str] = field(default_factory=list)

    def rows(self) -> list[list]:
        out = []
        for i, name in enumerate(self.files):
            values = [float(v[i]) for v in self.columns.values()]
            out.append([name, f"{self.sizes[i][0]}x{self.sizes[i][1]}", self.prompts[i]]
                       + [round(v, 4) if math.isfinite(v) else None for v in values])
        return out

    def headers(self) -> list[str]:
        return ["image", "size", "prompt"] + list(self.columns)


def _open_image(path: str | Path, limits: Limits):
    from PIL import Image, UnidentifiedImageError

    from flowrl.untrusted import open_image

    name = Path(path).name
    try:
        size = Path(path).stat().st_size
    except OSError as err:
        raise DemoInputError(f"cannot read {name}: {err.strerror or err}") from None
    if size > limits.max_upload_mb * 2**20:
        raise DemoInputError(f"{name} is {size / 2**20:.1f} MB; at most {limits.max_upload_mb} MB per image")
    try:
        with open_image(path) as image:  # PNG, JPEG or WebP only: an EPS renamed x.png never reaches Ghostscript
            width, height = image.size
            if max(width, height) > limits.max_image_side:
                raise DemoInputError(f"{name} is {width}x{height} px; at most {limits.max_image_side} px per side")
            return image.convert("RGB")
    except DemoInputError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise DemoInputError(f"{name} is not a readable image ({type(err).__name__}); "
                             "upload PNG, JPEG or WebP") from None


def score_files(paths: Sequence[str | Path], prompts: Sequence[str], rewards: RewardSet, names: Sequence[str], *,
                limits: Limits, resize_to: int | None = None) -> ScoreResult:
    """Score uploaded image files.

    Args:
        paths: the image files (at most ``limits.max_uploads``).
        prompts: one prompt for every image, or one per image in upload order.
        rewards / names: the rewards to score with.
        resize_to: resize each image to ``resize_to`` px square first (e.g. the shapes model's 32 px: the
            shapes reward measures objects in pixels); None keeps the uploaded size. Images are scored one
            at a time, so they may differ in size.

    Raises:
        DemoInputError: no images, too many, a file that is not an image or is too large, or a prompt count
            that matches neither 1 nor the number of images.
    """
    from PIL import Image
    from rewards import to_image_tensor

    if not paths:
        raise DemoInputError("upload at least one image")
    if len(paths) > limits.max_uploads:
        raise DemoInputError(f"{len(paths)} images uploaded; at most {limits.max_uploads} per request")
    if len(prompts) == 1:
        prompts = list(prompts) * len(paths)
    elif len(prompts) != len(paths):
        raise DemoInputError(f"{len(prompts)} prompts for {len(paths)} images: give one prompt for all, or one "
                             "per image (one per line, in upload order)")
    images, sizes = [], []
    for path in paths:
        image = _open_image(path, limits)
        sizes.append(image.size)
        if resize_to:
            shrink = resize_to < min(image.size)
            image = image.resize((resize_to, resize_to),
                                 Image.Resampling.BOX if shrink else Image.Resampling.BICUBIC)
        images.append(image)
    columns: dict[str, torch.Tensor] = {}
    warnings: list[str] = []
    per_image = []
    for image, prompt in zip(images, prompts):
        scored, found = rewards.score(to_image_tensor([image]), [prompt], names)
        per_image.append(scored)
        warnings += [w for w in found if w not in warnings]
    keys = list(dict.fromkeys(k for s in per_image for k in s))
    for key in keys:
        columns[key] = torch.cat([s.get(key, torch.full((1,), math.nan)) for s in per_image])
    return ScoreResult([Path(p).name for p in paths], list(prompts), sizes, columns, warnings)
