"""The Gradio app: tabs Compare, Trajectory, Score and Models.

Each tab's button is also an API endpoint (``/compare``, ``/trajectory``, ``/score``), so the demo can be
scripted with ``gradio_client``::

    from gradio_client import Client, handle_file
    client = Client("http://127.0.0.1:7860/")
    grid, means, per_image, status = client.predict(["base", "flow_grpo"], "a red circle", "0-3", 20, 1.0,
                                                    "ode", 0.7, ["shapes"], api_name="/compare")

Every handler turns a user's mistake (bad seeds, too many prompts, a missing checkpoint, a reward that
cannot read the prompt...) into a one-line ``gr.Error`` or ``gr.Warning``; an unexpected failure shows its
type in the UI and the traceback only on the server's console, never in the page.

What a visitor can reach is bounded (docs/security.md, "The demo"): messages and the Models tab show no
server paths (:func:`flowrl.demo.limits.public_text`), uploads and outputs leave Gradio's cache after
``Limits.cache_seconds``, the Score tab takes uploaded files only (file data naming a URL, which Gradio
would fetch from the server, is refused), and at most ``Limits.max_loaded_models`` fine-tuned models stay
loaded (:class:`flowrl.demo.models.ModelBank`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from flowrl.demo.engine import RewardSet
from flowrl.demo.handlers import guarded, one_line
from flowrl.demo.limits import (
    SAMPLERS,
    DemoInputError,
    Limits,
    check_choice,
    check_float,
    check_int,
    parse_prompt_list,
    parse_seed_list,
    public_text,
)
from flowrl.demo.models import ModelBank

__all__ = ["DemoState", "build_app", "theme", "DEFAULT_PROMPTS", "handle_compare", "handle_trajectory",
           "handle_score"]

log = logging.getLogger("flowrl.demo")

DEFAULT_PROMPTS = "a red circle\ntwo blue squares"
EXAMPLES = [
    ["a red circle\ntwo blue squares", "0-3"],
    ["a green triangle above a blue square", "0-5"],
    ["a red square and a purple triangle\nthree cyan triangles", "0-3"],
]
NOISE_DEFAULTS = {"ode": 0.7, "flow_sde": 0.7, "dance_sde": 0.3, "cps": 0.7}
CSS = """
#compare-grid img, #trajectory-strip img, #trajectory-plot img { max-width: 100%; height: auto; object-fit: contain; }
.flowrl-note { font-size: 0.9em; opacity: 0.85; }
"""


@dataclass
class DemoState:
    """What the handlers work with: the models, the rewards, the limits, and one lock so that only one
    generation runs at a time (sampling already uses every core; two would only thrash)."""

    bank: ModelBank
    rewards: RewardSet
    limits: Limits = field(default_factory=Limits)
    default_models: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    media_dir: str | None = None  # where the Compare tab writes its GIFs (None: a temporary folder, made once)

    def has_editing_models(self) -> bool:
        """Whether an editing model is offered (the Compare tab then shows its source upload)."""
        from flowrl.demo.engine import is_editing
        from flowrl.demo.models import family_edits

        return self._offers(is_editing, family_edits)

    def has_video_models(self) -> bool:
        """Whether a video model is offered (the Compare tab then shows its clips under the grid)."""
        from flowrl.demo.engine import is_video
        from flowrl.models.config import VIDEO_FAMILIES

        return self._offers(is_video, lambda family: family in VIDEO_FAMILIES)

    def _offers(self, of_model, of_family) -> bool:
        """Whether ``of_model(model)`` holds for a loaded model, or ``of_family(model.name)`` for a run not loaded
        yet (read from its config when it was found, so that nothing is loaded to lay out the page)."""
        for name in self.bank.names():
            if self.bank.is_loaded(name):
                if of_model(self.bank.get(name)):
                    return True
            elif of_family(self.bank.family(name)):
                return True
        return False

    def media_root(self) -> Path:
        """The folder of the Compare tab's clips, with the folders older than ``limits.cache_seconds`` removed."""
        import shutil
        import tempfile

        if self.media_dir is None:
            self.media_dir = tempfile.mkdtemp(prefix="flowrl-demo-media-")
        root = Path(self.media_dir)
        root.mkdir(parents=True, exist_ok=True)
        cutoff = time.time() - max(1, int(self.limits.cache_seconds))
        for folder in root.glob("compare-*"):
            try:
                if folder.stat().st_mtime < cutoff:
                    shutil.rmtree(folder, ignore_errors=True)
            except OSError:
                pass
        return root

    @property
    def base_name(self) -> str:
        return self.bank.names()[0]

    def base_model(self):
        return self.bank.get(self.base_name)

    @property
    def resolution(self) -> int | None:
        """The base model's image size in px when it is a pixel-space model (shapes), else None."""
        return getattr(getattr(self.base_model(), "config", None), "resolution", None)


# ============================================================================ errors and progress


class _Ticker:
    """Counts model calls into a ``gr.Progress`` (or nothing) with a known total."""

    def __init__(self, progress, total: int, desc: str = ""):
        self.progress, self.total, self.done, self.desc = progress, max(int(total), 1), 0, desc

    def __call__(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        if self.progress is not None:
            self.progress((self.done, self.total), desc=self.desc, unit="model calls")

    def describe(self, desc: str) -> None:
        self.desc = desc
        self(0)


def _warn(messages) -> None:
    import gradio as gr

    for message in messages:
        gr.Warning(public_text(message))


# ============================================================================ handlers


def _models(state: DemoState, names, progress=None) -> dict:
    """The selected models, loading any not loaded yet. With several selected, one that fails to load is
    skipped with a warning (a broken run under runs/ must not block the others)."""
    from flowrl.models.base import ModelLoadError

    if isinstance(names, str):
        names = [names]
    names = list(dict.fromkeys(names or []))
    if not names:
        raise DemoInputError("select at least one model")
    if len(names) > state.limits.max_models:
        raise DemoInputError(f"{len(names)} models selected; at most {state.limits.max_models} per request")
    models, failed = {}, []
    for name in names:
        if progress is not None and not state.bank.is_loaded(name):
            progress(0, desc=f"loading {name}")
        try:
            models[name] = state.bank.get(name)
        except ModelLoadError as err:
            if len(names) == 1:
                raise
            failed.append(f"skipped: {one_line(err)}")
    if not models:
        raise DemoInputError("none of the selected models loads: " + " | ".join(failed))
    _warn(failed)
    return models


def _guidance(value, state: DemoState) -> float:
    return check_float(value, "guidance", 0.0, state.limits.max_guidance)


def _noise(value, sampler: str) -> float | None:
    if sampler == "ode":
        return None
    return check_float(value if value is not None else NOISE_DEFAULTS[sampler], "noise level", 0.0, 1.0)


def handle_compare(state: DemoState, models, prompts, seeds, steps, guidance, sampler, noise_level, reward_names,
                   source=None, progress=None):
    """Compare tab: ``(grid image, mean rewards DataFrame, per-image DataFrame, status markdown, hacking panel
    DataFrame, clips)``.

    ``source``: the uploaded source image's file path (editing models; None without one). ``clips``: for video
    models, one ``(GIF path, caption)`` per clip (looping, 16 fps) in the grid's order; ``[]`` for images. A video's
    grid cell is its frame strip; an edit's grid row starts with the source (at the model's size).
    """
    import pandas as pd

    from flowrl.demo.engine import compare, open_source
    from flowrl.demo.render import grid_image

    limits = state.limits
    prompt_list = parse_prompt_list(prompts, limits)
    seed_list = parse_seed_list(seeds, limits)
    steps = check_int(steps, "steps", 1, limits.max_steps)
    guidance = _guidance(guidance, state)
    sampler = check_choice(sampler, "sampler", SAMPLERS)
    noise = _noise(noise_level, sampler)
    names = state.rewards.select(reward_names)
    n_models = len(models) if isinstance(models, (list, tuple)) else 1
    total = n_models * len(prompt_list) * len(seed_list)
    if total > limits.max_images:
        raise DemoInputError(f"{n_models} models x {len(prompt_list)} prompts x {len(seed_list)} seeds = {total} "
                             f"images; at most {limits.max_images} per request")
    source_path = _upload_path(source)
    source_image = open_source(source_path, limits) if source_path else None
    with state.lock:
        chosen = _models(state, models, progress)
        per_model_calls = steps * math.ceil(len(prompt_list) * len(seed_list) / 16)
        ticker = _Ticker(progress, per_model_calls * len(chosen))
        result = compare(chosen, prompt_list, seed_list, steps=steps, guidance=guidance, sampler=sampler,
                         noise_level=noise, rewards=state.rewards, reward_names=names, tick=ticker,
                         on_model=lambda m: ticker.describe(f"sampling {m}"), source=source_image)
    _warn(result.warnings)
    grid = _compare_grid(result, grid_image)
    means = pd.DataFrame(result.mean_rows(), columns=["model"] + [f"mean {c}" for c in result.columns])
    per_image = pd.DataFrame(result.sample_rows(), columns=["model", "prompt", "seed"] + result.columns)
    clips = _write_clips(state, result) if result.videos else []
    total = len(chosen) * len(prompt_list) * len(seed_list)
    what = "videos" if result.videos else ("edits" if result.sources else "images")
    status = (f"{total} {what}: {len(chosen)} model(s) x {len(prompt_list)} prompt(s) x {len(seed_list)} seed(s), "
              f"{steps} {sampler} steps, guidance {guidance:g}"
              + (f", noise level {noise:g}" if noise is not None else "")
              + (". Prompt: " + prompt_list[0] if len(prompt_list) == 1 else ""))
    if result.videos:
        frames = next(iter(result.images.values())).shape[1]
        status += f". Each cell is a clip's {frames} frames, left to right; the clips play under the grid."
    if result.sources:
        status += ". The first column is the source image, as each model saw it."
    return grid, means, per_image, status, _hacking_table(result, prompt_list, seed_list), clips


def _upload_path(value) -> str | None:
    """The server-side path of an upload (a path string, Gradio's FileData-like object or a dict), or None."""
    if value is None or value == "":
        return None
    if isinstance(value, dict):
        value = value.get("path") or value.get("name")
    path = value if isinstance(value, str) else getattr(value, "path", None) or getattr(value, "name", None)
    if not path:
        raise DemoInputError("the source image did not arrive: upload it again")
    return str(path)


def _compare_grid(result, grid_image):
    """The Compare grid: rows model (x prompt), columns the seeds; editing models' rows start with their
    source (the column ``source``, captionless), as ``flowrl sample --source`` draws it."""
    import torch

    prompts, seeds = result.prompts, result.seeds
    cells, captions = [], []
    for p in range(len(prompts)):
        for m in result.models:
            if result.sources:
                cells.append(result.sources[m][None].to(result.images[m].dtype))
                captions.append("")
            cells.append(result.images[m][p * len(seeds):(p + 1) * len(seeds)])
            captions += [result.caption(m, p * len(seeds) + s) for s in range(len(seeds))]
    row_labels = [m if len(prompts) == 1 else f"{m}\n{prompt}" for prompt in prompts for m in result.models]
    columns = (["source"] if result.sources else []) + [f"seed {s}" for s in seeds]
    return grid_image(torch.cat(cells), row_labels, columns, captions)


def _write_clips(state: DemoState, result) -> list[tuple[str, str]]:
    """Each clip of ``result`` as a looping GIF (16 fps, Wan's frame rate; ``flowrl.eval.grid.save_gif``, as ``flowrl
    sample`` writes them) in a fresh folder of the state's media directory; returns ``(path, caption)`` in the
    grid's order (prompt, then model, then seed). Folders older than ``Limits.cache_seconds`` are removed first
    (Gradio has copied each request's files into its own cache, which it cleans itself)."""
    import tempfile

    from flowrl.eval.grid import save_gif

    root = state.media_root()
    folder = Path(tempfile.mkdtemp(prefix="compare-", dir=root))
    clips = []
    for p, prompt in enumerate(result.prompts):
        for m in result.models:
            for s, seed in enumerate(result.seeds):
                i = p * len(result.seeds) + s
                path = folder / f"{len(clips):03d}_p{p}_s{seed}.gif"
                save_gif(result.images[m][i], path, fps=16.0)
                caption = f"{m}, seed {seed}" + (f": {prompt}" if len(result.prompts) > 1 else "")
                clips.append((str(path), caption))
    return clips


def _hacking_table(result, prompts: list[str], seeds: list[int]):
    """The reward-hacking panel (flowrl/eval/hacking.py) of each model's images: drift against the first model's
    images of the same noise, diversity across the seeds of a prompt, the image statistics of any world
    (flowrl/eval/image_stats.py: colour entropy and histogram shift, dark / saturated pixel fractions, high-frequency
    energy), and for the shapes world extra objects, background shift from white and strict-count accuracy."""
    import pandas as pd

    from flowrl.eval.hacking import hacking_panel, is_shapes_world, shapes_feature_fn

    labels = [p for p in prompts for _ in seeds]
    features = shapes_feature_fn() if is_shapes_world(prompts) else None
    first = result.models[0]
    rows = []
    for name in result.models:
        base = result.images[first] if name != first else None
        if base is not None and base.shape != result.images[name].shape:
            base = None  # e.g. two video models of different lengths: no pixel drift between them
        panel = hacking_panel(result.images[name], labels, base_images=base, features=features)
        rows.append({"model": name, **{k.removeprefix("hack/"): round(v, 4) for k, v in panel.items()
                                       if k.count("/") == 1 and k not in ("hack/bg_r", "hack/bg_g", "hack/bg_b")}})
    return pd.DataFrame(rows)


def handle_trajectory(state: DemoState, model_name, prompt, seed, steps, guidance, sampler, noise_level, reward_name,
                      cosine_window, progress=None):
    """Trajectory tab: ``(strip image, plot image, per-step DataFrame, summary markdown)``."""
    import pandas as pd

    from flowrl.demo.engine import trajectory
    from flowrl.demo.render import strip_image, trajectory_plot

    limits = state.limits
    prompts = parse_prompt_list(prompt, limits)
    if len(prompts) != 1:
        raise DemoInputError("the Trajectory tab takes one prompt (one line)")
    if isinstance(seed, float) and seed.is_integer():  # gr.Number may send 3.0
        seed = int(seed)
    seeds = parse_seed_list(seed, limits)
    if len(seeds) != 1:
        raise DemoInputError("the Trajectory tab takes one seed")
    steps = check_int(steps, "steps", 2, limits.max_trajectory_steps)
    guidance = _guidance(guidance, state)
    sampler = check_choice(sampler, "sampler", SAMPLERS)
    noise = _noise(noise_level, sampler)
    window = check_int(cosine_window, "cosine window", 1, limits.max_cosine_window)
    reward = None
    if reward_name:
        reward_name = state.rewards.select([reward_name])[0]
        reward = state.rewards.loaded[reward_name]
    with state.lock:
        (model,) = _models(state, [model_name], progress).values()
        completions = steps if sampler != "ode" and reward is not None else 0
        ticker = _Ticker(progress, steps + completions, desc=f"sampling {model_name}")
        result = trajectory(model, prompts[0], seeds[0], steps=steps, guidance=guidance, sampler=sampler,
                            noise_level=noise, reward=reward, reward_name=reward_name, cosine_window=window,
                            tick=ticker)
    _warn(result.warnings)
    strip = strip_image(result.x0_images, result.final, result.sigmas,
                        turning=None if result.turning is None else result.turning.tolist())
    plot = trajectory_plot(result)
    table = pd.DataFrame(result.table_rows(), columns=result.table_headers())
    lines = [f"**{model_name}**, {prompts[0]!r}, seed {seeds[0]}: {steps} steps ({result.num_sde} SDE steps, "
             f"sampler {sampler}), guidance {guidance:g}."]
    if result.R is not None:
        R = result.R
        lines.append(f"Final {reward_name}: {float(R[-1]):.3f}" + (f"; pure ODE rollout R_0: {float(R[0]):.3f}"
                                                                     if result.num_sde else ""))
    if result.turning is not None:
        tps = [t + 1 for t, flag in enumerate(result.turning.tolist()) if flag]
        lines.append(f"Turning points: {', '.join(map(str, tps)) if tps else 'none'} (red frames in the strip, "
                     "red circles on the curve).")
    if result.extra_nfe:
        lines.append(f"ODE completions: {result.extra_nfe} extra model evaluations.")
    return strip, plot, table, "  \n".join(lines)


def handle_score(state: DemoState, files, prompt, reward_names, resize):
    """Score tab: ``(scores DataFrame, status markdown)``."""
    import dataclasses

    import pandas as pd

    from flowrl.demo.engine import score_files

    limits = state.limits
    if isinstance(files, str):
        files = [files]
    paths = [f if isinstance(f, str) else getattr(f, "name", str(f)) for f in (files or [])]
    # One prompt for all images, or one per image: up to max_uploads lines.
    prompts = parse_prompt_list(prompt, dataclasses.replace(limits, max_prompts=limits.max_uploads))
    names = state.rewards.select(reward_names)
    resize_to = state.resolution if resize else None
    result = score_files(paths, prompts, state.rewards, names, limits=limits, resize_to=resize_to)
    _warn(result.warnings)
    table = pd.DataFrame(result.rows(), columns=result.headers())
    status = f"{len(paths)} image(s) scored with {', '.join(names)}" + (
        f" after resizing to {resize_to}x{resize_to} px" if resize_to else "")
    return table, status


# ============================================================================ layout


def _refusing_urls():
    """A mixin for Gradio upload components: file data naming an ``http(s)`` URL is refused, never fetched."""
    import gradio as gr
    from gradio_client.utils import is_http_url_like

    def refuse(url_or_file_path) -> None:
        if url_or_file_path is not None and is_http_url_like(str(url_or_file_path)):
            raise gr.Error("the demo does not fetch URLs: upload the image file itself", print_exception=False)

    class RefusingURLs:
        async def async_move_resource_to_block_cache(self, url_or_file_path):
            refuse(url_or_file_path)
            return await super().async_move_resource_to_block_cache(url_or_file_path)

        def move_resource_to_block_cache(self, url_or_file_path):
            refuse(url_or_file_path)
            return super().move_resource_to_block_cache(url_or_file_path)

    return RefusingURLs


def _upload_only_file():
    import gradio as gr

    class UploadOnlyFile(_refusing_urls(), gr.File):
        """``gr.File`` that takes uploads only. Gradio downloads file data that names an ``http(s)`` URL (an
        API client can send ``{"path": "https://...", "meta": {"_type": "gradio.FileData"}}``) from the
        server before any handler runs; this component refuses it instead, so the demo never fetches a URL
        on a visitor's behalf."""

        def get_block_name(self) -> str:
            return "file"  # the browser draws gr.File's own widget (a subclass's name has no frontend)

    return UploadOnlyFile


def _upload_only_image():
    import gradio as gr

    class UploadOnlyImage(_refusing_urls(), gr.Image):
        """``gr.Image`` (an upload box with a preview) that takes uploaded files only and leaves their decoding to
        the demo. Like :class:`UploadOnlyFile` it refuses file data naming a URL; and where ``gr.Image`` would open
        the upload with ``PIL.Image.open`` (every format PIL knows) before the handler runs, this one hands the
        handler the uploaded file's path, which the demo opens as PNG, JPEG or WebP only
        (:func:`flowrl.demo.engine.open_source`, ``flowrl.untrusted.open_image``). A ``data:`` URL is refused too
        (Gradio would decode it with PIL)."""

        def get_block_name(self) -> str:
            return "image"  # the browser draws gr.Image's own widget (a subclass's name has no frontend)

        def preprocess(self, payload):
            if payload is None:
                return None
            if (payload.url or "").startswith("data:") or payload.path is None:
                raise gr.Error("upload the source image as a file (PNG, JPEG or WebP)", print_exception=False)
            return str(payload.path)

    return UploadOnlyImage


def theme():
    """The Soft theme with system fonts: the page loads nothing from the internet (offline machines)."""
    import gradio as gr

    system = ["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "Roboto", "Helvetica", "Arial", "sans-serif"]
    mono = ["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"]
    return gr.themes.Soft(font=system, font_mono=mono)


def _models_markdown(state: DemoState) -> str:
    """The Models tab: names, kinds and states (no server paths: the command line has those)."""
    lines = ["| model | kind | state |", "|---|---|---|"]
    for row in state.bank.describe():
        lines.append(f"| {row['name']} | {row['kind']} | {public_text(row['state'])} |")
    lines += ["", "**Rewards loaded:** " + (", ".join(state.rewards.loaded) or "none")]
    if state.rewards.failed:
        lines += ["", "**Rewards not available** (start with `--reward NAME` once the weights are present):"]
        lines += [f"- `{name}`: {public_text(reason)}" for name, reason in state.rewards.failed.items()]
    from rewards import available

    others = [n for n in available() if n not in state.rewards.loaded and n not in state.rewards.failed]
    if others:
        lines += ["", "Other registered rewards (not requested; add with `--reward NAME`): "
                  + ", ".join(f"`{n}`" for n in others)]
    return "\n".join(lines)


def build_app(state: DemoState, *, title: str = "flowrl: compare base and fine-tuned generators"):
    """The ``gr.Blocks`` of the demo (not launched)."""
    import gradio as gr

    UploadOnlyFile = _upload_only_file()
    UploadOnlyImage = _upload_only_image()
    limits = state.limits
    names = state.bank.names()
    base = state.base_model()
    default_guidance = float(getattr(base, "default_guidance", 1.0))
    default_models = state.default_models or names[:1]
    reward_names = state.rewards.names
    any_editing, any_video = state.has_editing_models(), state.has_video_models()
    concurrency = {"concurrency_limit": 1, "concurrency_id": "generate"}

    @guarded
    def run_compare(models, prompts, seeds, steps, guidance, sampler, noise_level, rewards_, source=None,
                    progress=gr.Progress()):
        return handle_compare(state, models, prompts, seeds, steps, guidance, sampler, noise_level, rewards_,
                              source=source, progress=progress)

    @guarded
    def run_trajectory(model, prompt, seed, steps, guidance, sampler, noise_level, reward, window,
                       progress=gr.Progress()):
        return handle_trajectory(state, model, prompt, seed, steps, guidance, sampler, noise_level, reward, window,
                                 progress=progress)

    @guarded
    def run_score(files, prompt, rewards_, resize):
        return handle_score(state, files, prompt, rewards_, resize)

    cache = max(1, int(limits.cache_seconds))
    with gr.Blocks(title="flowrl demo", analytics_enabled=False, delete_cache=(min(600, cache), cache)) as demo:
        gr.Markdown(f"## {title}\nSame prompts, same seeds, same noise: one row per model, one column per seed, "
                    "each image with its rewards. The **Trajectory** tab shows where along the denoising a model "
                    "changes its mind.")
        if state.rewards.failed:
            gr.Markdown("Rewards not available: " + ", ".join(f"`{n}`" for n in state.rewards.failed)
                        + " (the **Models** tab says why and how to add them).", elem_classes=["flowrl-note"])
        with gr.Tabs():
            with gr.Tab("Compare", id="compare"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=300):
                        c_models = gr.CheckboxGroup(names, value=default_models, label="Models",
                                                    info=f"rows of the grid (at most {limits.max_models})",
                                                    elem_id="compare-models")
                        c_prompts = gr.Textbox(DEFAULT_PROMPTS, lines=3, max_lines=limits.max_prompts,
                                               label="Prompts (one per line)", elem_id="compare-prompts",
                                               max_length=limits.max_prompts * (limits.max_prompt_chars + 1))
                        c_seeds = gr.Textbox("0-3", label="Seeds (columns)", info="'4', '0-7' or '0,3,5'",
                                             elem_id="compare-seeds")
                        with gr.Row():
                            c_steps = gr.Slider(1, limits.max_steps, value=20, step=1, label="Steps",
                                                elem_id="compare-steps")
                            c_guidance = gr.Slider(0, min(15.0, limits.max_guidance), value=default_guidance,
                                                   step=0.5, label="Guidance")
                        c_sampler = gr.Radio(list(SAMPLERS), value="ode", label="Sampler")
                        c_noise = gr.Slider(0, 1, value=0.7, step=0.05, label="Noise level",
                                            info="SDE samplers: flow_sde / cps a, dance_sde eta")
                        c_rewards = gr.CheckboxGroup(reward_names, value=reward_names, label="Rewards")
                        c_source = UploadOnlyImage(type="filepath", sources=["upload"], format="png",
                                                   label="Source image (editing models only)",
                                                   elem_id="compare-source", visible=any_editing, height=200)
                        c_run = gr.Button("Generate", variant="primary", elem_id="compare-run")
                        gr.Examples(EXAMPLES, [c_prompts, c_seeds], label="Example prompts")
                    with gr.Column(scale=3):
                        c_grid = gr.Image(label="Grid: one row per model, one column per seed", show_label=False,
                                          type="pil", format="png", interactive=False, elem_id="compare-grid")
                        c_means = gr.Dataframe(label="Mean reward per model", interactive=False,
                                               elem_id="compare-means")
                        c_status = gr.Markdown(elem_id="compare-status")
                        c_clips = gr.Gallery(label="Clips of the video models (looping GIFs, 16 fps; row by row "
                                                   "as in the grid)", visible=any_video, columns=4, height="auto",
                                             object_fit="contain", interactive=False,
                                             elem_id="compare-clips")
                        c_hack = gr.Dataframe(label="Reward hacking: what the reward cannot see (drift from the "
                                              "first model's images of the same noise, diversity over seeds, "
                                              "colour entropy in bits and histogram shift from the first model, "
                                              "dark / saturated pixel and high-frequency energy fractions; for "
                                              "shapes: extra objects, background shift from white in 0-255 "
                                              "units, strict-count accuracy)", interactive=False,
                                              elem_id="compare-hacking")
                        with gr.Accordion("Scores of every image", open=False):
                            c_table = gr.Dataframe(interactive=False, elem_id="compare-table")
                c_sampler.change(lambda s: NOISE_DEFAULTS.get(s, 0.7), c_sampler, c_noise, api_visibility="private")
                c_run.click(run_compare,
                            [c_models, c_prompts, c_seeds, c_steps, c_guidance, c_sampler, c_noise, c_rewards,
                             c_source],
                            [c_grid, c_means, c_table, c_status, c_hack, c_clips], api_name="compare", **concurrency)

            with gr.Tab("Trajectory", id="trajectory"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=300):
                        t_model = gr.Dropdown(names, value=default_models[-1], label="Model")
                        t_prompt = gr.Textbox("a red circle", label="Prompt", max_length=limits.max_prompt_chars)
                        t_seed = gr.Number(0, precision=0, minimum=0, maximum=limits.max_seed, label="Seed")
                        with gr.Row():
                            t_steps = gr.Slider(2, limits.max_trajectory_steps, value=10, step=1, label="Steps")
                            t_guidance = gr.Slider(0, min(15.0, limits.max_guidance), value=default_guidance,
                                                   step=0.5, label="Guidance")
                        t_sampler = gr.Radio(list(SAMPLERS), value="flow_sde", label="Sampler",
                                             info="SDE steps are where turning points can happen")
                        t_noise = gr.Slider(0, 1, value=0.7, step=0.05, label="Noise level")
                        t_reward = gr.Dropdown(reward_names, value=reward_names[0] if reward_names else None,
                                               label="Reward of the curve")
                        t_window = gr.Slider(1, limits.max_cosine_window, value=1, step=1,
                                             label="Cosine-credit window W")
                        t_run = gr.Button("Run trajectory", variant="primary", elem_id="trajectory-run")
                    with gr.Column(scale=3):
                        gr.Markdown("Predicted clean image `x - sigma v` at every step, then the sample "
                                    "(turning points framed in red)")
                        t_strip = gr.Image(show_label=False, type="pil", format="png", interactive=False,
                                           elem_id="trajectory-strip")
                        t_plot = gr.Image(show_label=False, type="pil", format="png", interactive=False,
                                          elem_id="trajectory-plot")
                        t_summary = gr.Markdown()
                        with gr.Accordion("Per-step values", open=False):
                            t_table = gr.Dataframe(interactive=False)
                t_sampler.change(lambda s: NOISE_DEFAULTS.get(s, 0.7), t_sampler, t_noise, api_visibility="private")
                t_run.click(run_trajectory,
                            [t_model, t_prompt, t_seed, t_steps, t_guidance, t_sampler, t_noise, t_reward, t_window],
                            [t_strip, t_plot, t_table, t_summary], api_name="trajectory", **concurrency)

            with gr.Tab("Score", id="score"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=300):
                        s_files = UploadOnlyFile(file_count="multiple", file_types=["image"], type="filepath",
                                                 label=f"Images (at most {limits.max_uploads}, "
                                                       f"{limits.max_image_side} px per side)")
                        s_prompt = gr.Textbox("a red circle", lines=2, label="Prompt",
                                              info="one for every image, or one per image (one per line)")
                        s_rewards = gr.CheckboxGroup(reward_names, value=reward_names, label="Rewards")
                        resolution = state.resolution
                        s_resize = gr.Checkbox(bool(resolution), label=f"Resize to the model's resolution "
                                                                        f"({resolution} px) first",
                                               visible=bool(resolution))
                        s_run = gr.Button("Score", variant="primary", elem_id="score-run")
                    with gr.Column(scale=2):
                        s_table = gr.Dataframe(label="Rewards", interactive=False)
                        s_status = gr.Markdown()

                s_run.click(run_score, [s_files, s_prompt, s_rewards, s_resize], [s_table, s_status],
                            api_name="score", **concurrency)

            from flowrl.demo.agent_tab import add_agent_tab

            add_agent_tab(getattr(state, "runs_dir", "runs"), concurrency)

            with gr.Tab("Models", id="models"):
                models_md = gr.Markdown(_models_markdown(state))
                gr.Button("Refresh", size="sm").click(lambda: _models_markdown(state), None, models_md,
                                                      api_visibility="private")
    return demo
