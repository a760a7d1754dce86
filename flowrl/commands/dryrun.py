"""``flowrl train CONFIG [a.b=c ...] --dry-run``: check a config end to end without its weights.

1. The config loads and validates (every key, value and reward name), with the overrides.
2. A tiny model of the config's own architecture is built offline (``flowrl.testing``: a tiny SD3 or FLUX
   pipeline, a tiny shapes model; the pretraining recipe's own shapes architecture is small enough to keep),
   with the config's LoRA targets, dtype, gradient checkpointing and guidance.
3. One epoch of the config's recipe runs on it, with the config's algorithm settings (sampler, window,
   advantage estimator, loss, KL, minibatches, EMA) and a few samples (2 groups of 2, 2 evaluation prompts).
   A reward whose weights are missing (or whose server does not answer) and a prompt file that does not exist
   are replaced by stand-ins, and the report says which.
4. It prints what the real run needs: the weights and where they are, rewards and prompt files, a rough memory
   estimate at the configured resolution and batch (``flowrl.models.footprint``), and the work of one epoch.

A recipe whose config needs more than the generic shrinking below defines
``dry_run_overrides(data: dict, workdir: Path) -> list[str]`` in its module: it edits the config mapping in place
and returns notes for the report. A recipe whose epoch is not a rollout followed by training on its denoising steps
defines ``dry_run_work(cfg) -> list[str]``: the lines that describe one epoch's work in the report. A recipe that holds
more or fewer models than the shared parts defines ``dry_run_memory(cfg) -> dict`` (see ``_memory``): DMD2's fake score.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["dry_run", "STAND_IN_REWARD", "STAND_IN_PROMPTS", "STAND_IN_EDITS", "DryRunResult"]

#: Scores any image without weights (JPEG size), so advantages are non-zero on random tiny models.
STAND_IN_REWARD = "jpeg_incompressibility"
STAND_IN_PROMPTS = ["a red apple on a wooden table", "a blue car parked in the rain", "a cat sleeping on a mat",
                    "a bowl of soup next to a spoon"]
#: An editing model's stand-in prompts: these instructions, each on a random source image (editing shards).
STAND_IN_EDITS = ["make the apple red", "turn the car blue", "make the cat small", "put a spoon next to the bowl"]


class DryRunResult(dict):
    """The report as data (tests read it): ``exit_code``, ``notes``, ``needs``, ``seconds``."""


def _set(data: dict, dotted: str, value: Any) -> bool:
    """Set ``a.b.c`` if the section ``a.b`` exists and has key ``c`` (the recipe's config has it)."""
    *path, last = dotted.split(".")
    node = data
    for key in path:
        if not isinstance(node, dict) or not isinstance(node.get(key), dict):
            return False
        node = node[key]
    if last not in node:
        return False
    node[last] = value(node[last]) if callable(value) else value
    return True


# Shrink rules: (key, value or function of the configured value). Applied only where the config has the key.
_SHRINK: list[tuple[str, Any]] = [
    ("run.max_epochs", 1), ("run.max_minutes", None), ("run.resume", False), ("run.overwrite", False),
    ("sampling.group_size", 2), ("sampling.groups_per_epoch", 2), ("sampling.batch_size", 4),
    ("sampling.eval_num_steps", lambda v: min(v, 2)),
    ("train.micro_batch_size", lambda v: min(v, 4)), ("train.minibatches", lambda v: min(v, 2)),
    ("data.num_eval_prompts", 2), ("data.batch_size", lambda v: min(v, 4)), ("data.steps_per_epoch", 1),
    ("eval.at_start", False), ("eval.every_epochs", 1), ("eval.every_minutes", None),
    ("eval.batch_size", lambda v: min(v, 2)), ("eval.grid_size", lambda v: min(v, 2)),
    ("eval.num_prompts", lambda v: min(v, 2)), ("eval.steps", lambda v: min(v, 2)),
    ("eval.num_examples", lambda v: min(v, 4)), ("eval.num_zoom_examples", lambda v: min(v, 2)),  # VLM episodes
    ("checkpoint.every_epochs", 1), ("optim.warmup_steps", lambda v: min(v, 1)),
]


def _tiny_model(data: dict, workdir: Path, notes: list[str]) -> None:
    """Point the ``model`` section at a tiny model of the same architecture, built offline."""
    from flowrl.models.base import check_attention_backend
    from flowrl.models.families import FAMILIES
    from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny

    model = data.get("model")
    if not isinstance(model, dict):
        return
    name = model.get("name")
    if name in FAMILIES:
        two_experts = name == "wan" and "A14B" in str(model.get("path", ""))  # Wan 2.2: the tiny two-expert pipeline
        model["path"] = str(build_tiny("wan22" if two_experts else name))
        model["resolution"] = TINY_RESOLUTION
        model["max_sequence_length"] = TINY_MAX_SEQUENCE_LENGTH
        if name == "wan":  # video: a tiny clip of 5 frames (2 latent frames)
            from flowrl.testing.tiny_wan import TINY_WAN_NUM_FRAMES

            model["num_frames"] = TINY_WAN_NUM_FRAMES
        notes.append(f"model: a tiny {FAMILIES[name].label} pipeline of the same structure (random weights, "
                     f"{TINY_RESOLUTION} px), with the config's LoRA, dtype and gradient checkpointing")
    elif name == "shapes":
        from flowrl.models.shapes import ShapesModel, ShapesModelConfig

        path = workdir / "tiny_shapes"
        config = ShapesModelConfig(block_out_channels=[8, 16], head_dim=8, text_hidden_size=16, text_layers=1,
                                   text_heads=2)
        ShapesModel.build(config, seed=0).save_pretrained(path)
        model["path"] = str(path)
        notes.append("model: a tiny shapes model (random weights) with the config's LoRA and dtype")
    elif name is None and isinstance(model.get("path"), str) and not Path(model["path"]).exists():
        _tiny_policy(model, workdir, notes)  # a VLM policy named by a hub id
        return
    else:
        return  # the pretraining recipe's own architecture (the shapes model config) is already small
    backend = model.get("attention_backend", "native")
    try:
        check_attention_backend(backend, "cuda" if _cuda() else "cpu")
    except Exception as err:  # noqa: BLE001 - a ConfigError naming the fix
        model["attention_backend"] = "native"
        notes.append(f"model.attention_backend: {backend} cannot run here ({str(err).split(': ', 1)[-1]}); the dry "
                     "run uses native")


def _tiny_policy(model: dict, workdir: Path, notes: list[str]) -> None:
    """Point a VLM policy's ``model.path`` (a hub id without local weights) at a tiny model of its family."""
    from flowrl.policies import testing

    hub_id = model["path"]
    key = hub_id.lower().replace("_", "").replace("-", "").replace(".", "")
    builders = [("qwen25vl", testing.tiny_qwen2_5_vl), ("qwen2vl", testing.tiny_qwen2_vl),
                ("smolvlm", testing.tiny_smolvlm), ("idefics3", testing.tiny_idefics3)]
    build = next((b for tag, b in builders if tag in key), testing.tiny_causal_lm)
    model["path"] = build(workdir / "tiny_policy")
    model["gradient_checkpointing"] = False
    if model.get("dtype") == "bfloat16" and not _cuda():
        model["dtype"] = "float32"
    notes.append(f"model: a tiny random model of the same family as {hub_id} (no weights here; the real run "
                 f"needs `huggingface-cli download {hub_id}`)")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _edits(data: dict) -> bool:
    """The config trains an editing model (flowrl.models.families: its prompts come with source images)."""
    from flowrl.models.families import FAMILIES

    model = data.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    return name in FAMILIES and FAMILIES[name].edits


def _stand_in_edits(directory: Path) -> Path:
    """Editing shards of :data:`STAND_IN_EDITS`, each on a random source at the tiny resolution."""
    import numpy as np

    from flowrl.data.edit_prompts import write_edit_shards
    from flowrl.testing import TINY_RESOLUTION

    rng = np.random.default_rng(0)
    side = TINY_RESOLUTION
    write_edit_shards([(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), text, None, None)
                       for text in STAND_IN_EDITS], directory)
    return directory


def _prompts(data: dict, workdir: Path, notes: list[str], needs: list[str]) -> list[tuple[str, dict]]:
    """Stand-in prompt files for the ones that do not exist (editing shards for an editing model); returns a few
    (prompt, metadata) to probe rewards."""
    from flowrl.data.prompts import PromptSetError, load_prompts
    from flowrl.testing import TINY_RESOLUTION

    section = data.get("data")
    probe: list[tuple[str, dict]] = []
    if not isinstance(section, dict):
        return probe
    edits = _edits(data)
    for key in ("train_prompts", "eval_prompts"):
        source = section.get(key)
        if not isinstance(source, str):
            continue
        try:
            prompts = load_prompts(source, 4, resolution=TINY_RESOLUTION if edits else None)
            needs.append(f"{key}: {source} (found)")
            probe = probe or list(zip(prompts.prompts[:2], prompts.metadata[:2]))
        except PromptSetError as err:
            if edits:  # the rewards are probed with the stand-in sources too (clip_directional reads them)
                stand_in, kind = _stand_in_edits(workdir / f"stand_in_{key}"), "editing prompts (random sources)"
                stand_ins = load_prompts(str(stand_in), resolution=TINY_RESOLUTION)
                probe = probe or list(zip(stand_ins.prompts[:2], stand_ins.metadata[:2]))
            else:
                stand_in, kind = workdir / f"stand_in_{key}.txt", "prompts"
                stand_in.write_text("\n".join(STAND_IN_PROMPTS) + "\n")
            section[key] = str(stand_in)
            needs.append(f"{key}: {source} is MISSING ({err}); the dry run used {len(STAND_IN_PROMPTS)} stand-in "
                         f"{kind}")
            notes.append(f"data.{key}: stand-in {kind} ({source} does not exist)")
    return probe or [(p, {}) for p in STAND_IN_PROMPTS[:2]]


def _probe_reward(name: str, value: Any, probe: list[tuple[str, dict]]) -> str | None:
    """None when the reward builds and scores two images here, else why not (one line)."""
    import torch

    from rewards.compose import build_reward

    try:
        reward = build_reward({name: value}, device="cpu")
        images = torch.rand(len(probe), 3, 64, 64, generator=torch.Generator().manual_seed(0))
        out = reward(images, [p for p, _ in probe], [m for _, m in probe])
        if out.scores.numel() != len(probe):
            return f"returned {out.scores.numel()} scores for {len(probe)} images"
    except Exception as err:  # noqa: BLE001 - missing weights, unreachable server, ...: all reported
        return " ".join(str(err).split())[:300] or type(err).__name__
    return None


def _rewards(data: dict, probe: list[tuple[str, dict]], notes: list[str], needs: list[str]) -> None:
    """Replace the rewards that cannot score here by the stand-in, keeping their names and weights."""
    section = data.get("reward")
    if not isinstance(section, dict) or not isinstance(section.get("train"), dict):
        return
    train = section["train"]
    for name, value in list(train.items()):
        problem = _probe_reward(name, value, probe)
        if problem is None:
            needs.append(f"reward {name}: loads and scores here")
            continue
        weight = value.get("weight", 1.0) if isinstance(value, dict) else value
        train[name] = {"reward": STAND_IN_REWARD, "weight": weight}
        needs.append(f"reward {name}: NOT AVAILABLE here ({problem})")
        notes.append(f"reward.train.{name}: replaced by the stand-in {STAND_IN_REWARD} (weight {weight})")
    evals = section.get("eval")
    if isinstance(evals, list):
        kept = []
        for name in evals:
            if name in train:
                kept.append(name)
                continue
            problem = _probe_reward(name, 1.0, probe)
            if problem is None:
                kept.append(name)
                needs.append(f"reward {name} (eval): loads and scores here")
            else:
                kept.append(STAND_IN_REWARD)
                needs.append(f"reward {name} (eval): NOT AVAILABLE here ({problem})")
                notes.append(f"reward.eval: {name} replaced by the stand-in {STAND_IN_REWARD}")
        section["eval"] = list(dict.fromkeys(kept))


#: Families whose guidance is an embedding the transformer takes (no second, unconditional row).
_GUIDANCE_EMBEDDED = ("flux", "flux2", "flux_kontext")


def _epoch_work(cfg, recipe_work=None) -> list[str]:
    """What one epoch of the real run does (model evaluations, passes, optimizer steps). ``recipe_work``: the
    recipe module's ``dry_run_work(cfg) -> list[str]``, for a recipe whose epoch is not a rollout followed by
    training on its denoising steps (it replaces those lines; the evaluation's line stays)."""
    if recipe_work is not None:
        return list(recipe_work(cfg)) + _evaluation_work(cfg)
    lines = []
    s = getattr(cfg, "sampling", None)
    t = getattr(cfg, "train", None)
    if s is None:
        data = getattr(cfg, "data", None)
        if data is not None and hasattr(data, "steps_per_epoch"):
            lines.append(f"{data.steps_per_epoch} optimizer steps per epoch of {data.batch_size} images")
        return lines
    if not hasattr(s, "num_steps"):  # a text policy (VLM recipes): episodes of generated tokens
        samples = s.samples_per_epoch if hasattr(s, "samples_per_epoch") else s.group_size * s.groups_per_epoch
        lines.append(f"{samples} episodes per epoch ({s.groups_per_epoch} prompts x {s.group_size}), up to "
                     f"{s.max_new_tokens} new tokens per turn, in generate calls of {s.batch_size}")
        return lines
    model = getattr(cfg, "model", None)
    cfg_rows = 2 if (s.guidance != 1.0 and getattr(model, "name", "") not in _GUIDANCE_EMBEDDED) else 1
    samples = s.samples_per_epoch
    lines.append(f"{samples} samples per epoch ({s.groups_per_epoch} prompts x {s.group_size}), {s.num_steps} "
                 f"denoising steps: {samples * s.num_steps * cfg_rows:,} transformer rows in the rollout "
                 f"({'with' if cfg_rows == 2 else 'no'} classifier-free guidance), in calls of {s.batch_size}")
    window = s.window
    trained = window.size if window.size is not None else s.num_steps - 1 - window.start
    what = "trained steps"
    if t is not None and hasattr(t, "times"):  # a forward-process trainer: the clean samples noised at train.times
        trained, what = t.times.count, "training times"
    if t is not None and hasattr(t, "minibatches"):
        inner = getattr(t, "inner_epochs", 1)
        passes = samples * trained * inner
        lines.append(f"training: {trained} {what} x {samples} samples x {inner} inner epoch(s) = {passes:,} "
                     f"forward-backward rows ({cfg_rows} each with guidance) in micro-batches of "
                     f"{t.micro_batch_size}; {t.minibatches * inner} optimizer step(s) per epoch")
    return lines + _evaluation_work(cfg)


def _evaluation_work(cfg) -> list[str]:
    """The held-out evaluation's line: when, and how many prompts at how many ODE steps."""
    ev, data, s = getattr(cfg, "eval", None), getattr(cfg, "data", None), getattr(cfg, "sampling", None)
    if ev is None or data is None or s is None or not getattr(data, "num_eval_prompts", None):
        return []
    when = [f"every {ev.every_epochs} epochs" if getattr(ev, "every_epochs", None) else "",
            f"every {ev.every_minutes:g} minutes" if getattr(ev, "every_minutes", None) else ""]
    when = " and ".join(w for w in when if w) or "at the end"
    return [f"evaluation {when}: {data.num_eval_prompts} prompts x {s.eval_num_steps} ODE steps"]


def _snapshot_copies(cfg) -> int:
    """Float32 copies of the trained tensors the recipe keeps beside the EMA
    (:class:`flowrl.rl.param_snapshots.ParamSnapshot`), read from its ``train`` section: one per
    :class:`~flowrl.rl.param_snapshots.SnapshotConfig` field (NFT's ``old``, CRD's ``old`` and ``rollout_snapshot``,
    DGPO's ``ema_snapshot``, AWM's only with ``ema_kl_coef > 0``, as its recipe builds it), two for Flow-GRPO's
    ``elastic_reset`` (its base and its EMA)."""
    from dataclasses import fields, is_dataclass

    from flowrl.rl.elastic_reset import ElasticResetConfig
    from flowrl.rl.param_snapshots import SnapshotConfig

    train = getattr(cfg, "train", None)
    if not is_dataclass(train):
        return 0
    count = 0
    for f in fields(train):
        value = getattr(train, f.name)
        if isinstance(value, SnapshotConfig):
            count += not (f.name == "ema_snapshot" and getattr(train, "ema_kl_coef", None) == 0)
        elif isinstance(value, ElasticResetConfig):
            count += 2
    return count


def _memory(cfg, objective: bool | None = None, recipe_memory=None) -> list[str]:
    """The architecture and the rough memory per GPU of the real run (:func:`flowrl.models.footprint.memory_estimate`).

    ``objective``: what the recipe declared about its objective's use of the reference for this config
    (:class:`flowrl.rl.setup.ImageTraining`'s ``reference``, recorded during the tiny epoch); None when not known (the
    tiny epoch stopped before): a full fine-tune's reference copy is then counted. ``recipe_memory``: the recipe
    module's ``dry_run_memory(cfg) -> dict``, for a recipe that holds more than the shared parts or fewer:
    ``fake_score`` (a second trained copy of the trained tensors with its own optimizer: DMD2, DMDR), ``teacher`` (a
    frozen second denoiser: on-policy distillation),
    ``train_reward`` (False: the training reward is not built) and ``notes`` (lines for the report)."""
    from flowrl.models.footprint import footprint, format_gib, memory_estimate, reward_memory
    from flowrl.rl.setup import reference_uses

    model = getattr(cfg, "model", None)
    if model is None or not hasattr(model, "lora") or not hasattr(model, "name"):
        return []  # no model, or a token policy (VLM recipes): the estimate sizes image generators
    try:
        fp = footprint(model)
    except Exception as err:  # noqa: BLE001 - an unreadable local config: say so, do not fail the dry run
        return [f"memory: cannot read the architecture ({' '.join(str(err).split())[:200]})"]
    if fp is None:
        return [f"memory: unknown architecture for {model.path} (not cached, not a published flowrl model); "
                "point model.path at a local copy for an estimate"]
    s, t = getattr(cfg, "sampling", None), getattr(cfg, "train", None)
    guidance = s is not None and s.guidance != 1.0 and model.name not in _GUIDANCE_EMBEDDED
    uses = reference_uses(cfg.sampling, cfg.eval, True if objective is None else objective)
    parts = dict(recipe_memory(cfg)) if recipe_memory is not None else {}
    rewards = reward_memory(cfg.reward) if hasattr(cfg, "reward") else {}
    if not parts.get("train_reward", True):  # the recipe builds no training reward (DMD2)
        rewards = {k: v for k, v in rewards.items() if "(train," not in k}
    snapshots = _snapshot_copies(cfg)
    fake_score, teacher = bool(parts.get("fake_score")), bool(parts.get("teacher"))
    est = memory_estimate(model, fp, micro_batch=getattr(t, "micro_batch_size", 1),
                          guidance=guidance, ema=getattr(t, "ema_decay", None) is not None, reference=bool(uses),
                          snapshots=snapshots, rewards=sum(rewards.values()), fake_score=fake_score,
                          teacher=teacher)
    params = ", ".join(f"{k} {v / 1e6:,.1f}M" for k, v in fp.params.items())
    lines = [f"architecture ({fp.source}): {params}; trained {fp.trainable / 1e6:,.2f}M "
             f"({'LoRA r%d' % model.lora.rank if model.lora else 'full fine-tuning'})"
             + "".join(f"; {note}" for note in fp.notes)]
    res = model.resolution or "default"
    lines.append(f"memory per GPU, rough (DDP or 1 GPU, {model.dtype}, {res} px, micro-batch "
                 f"{getattr(t, 'micro_batch_size', '?')}, gradient checkpointing "
                 f"{'on' if model.gradient_checkpointing else 'off'}): "
                 + ", ".join(f"{k} {format_gib(v)}" for k, v in est.items()))
    if model.lora is None:
        if uses:
            why = ", ".join(uses) + (" (assumed: the tiny epoch did not reach the recipe's declaration)"
                                     if objective is None else "")
            if any(use.startswith("eval.") for use in uses):
                why += "; eval.hacking.enabled=false and eval.grid_size=0 drop the evaluation's uses"
            lines.append(f"memory: full fine-tuning keeps a frozen reference copy of the denoiser ({model.dtype}) for: "
                         f"{why}")
        else:
            lines.append("memory: full fine-tuning keeps no reference copy (nothing uses the reference)")
        if model.dtype != "float32":
            lines.append(f"memory: full fine-tuning in {model.dtype} trains float32 master weights (their gradients "
                         f"and AdamW's moments float32 too) and computes in {model.dtype} under autocast")
    if "text encoders lent to encode" in est:
        lines.append(f"memory: text encoders offloaded to the CPU ({format_gib(est['text encoders lent to encode'])} "
                     "on the device only while new prompts are encoded, never beside the training step's activations: "
                     "the total counts the larger; model.offload_text_encoders=false keeps them resident)")
    if rewards:
        lines.append("memory: reward models (each built copy; on a GPU 'auto' precision is bf16): "
                     + ", ".join(f"{k} {format_gib(v / 2 ** 30)}" for k, v in rewards.items()))
    if snapshots:
        lines.append(f"memory: {snapshots} float32 snapshot(s) of the trained weights (flowrl.rl.param_snapshots)")
    if fake_score:
        lines.append(f"memory: the fake score, a second float32 copy of the {fp.trainable / 1e6:,.2f}M trained "
                     f"parameters with its gradients and AdamW's two moments ({format_gib(est['fake score'])})"
                     + ("; a full fine-tune's is a whole second denoiser" if model.lora is None else ""))
    if teacher:
        lines.append(f"memory: the teacher of on-policy distillation, a second frozen denoiser in {model.dtype} "
                     f"({format_gib(est['teacher'])}; its text encoders and VAE are not loaded beside it)")
    if not parts.get("train_reward", True) and getattr(getattr(cfg, "reward", None), "train", None):
        lines.append("memory: no training reward is built (the recipe trains on none; the evaluation's is counted)")
    lines.extend(f"memory: {note}" for note in parts.get("notes", ()))
    return lines


def dry_run(config: str, overrides: list[str], *, out: Callable[[str], None] = print,
            workdir: str | Path | None = None) -> DryRunResult:
    """Run the dry run (see the module docstring) and print its report with ``out``.

    Returns:
        A :class:`DryRunResult` (``exit_code`` 0 when the tiny epoch ran).

    Raises:
        ConfigError: the config (with the overrides) does not load.
    """
    from flowrl.recipes import load_recipe_config

    start = time.perf_counter()
    recipe, cfg = load_recipe_config(config, overrides)
    with _offline():
        return _dry_run(recipe, cfg, config, out, workdir, start)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Nothing is downloaded during a dry run: the hub libraries see offline mode (they read it at import, so
    their constant is set too), and a missing weight fails at once instead of after minutes of retries."""
    import os

    import huggingface_hub.constants as hub_constants

    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    saved_constant = hub_constants.HF_HUB_OFFLINE
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE = saved_constant
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _cpu_precision(data: dict, notes: list[str]) -> None:
    """A tiny epoch on a CPU without bfloat16 hardware runs in float32: bf16 autocast is refused there (emulated,
    ~30x slower; :func:`flowrl.hardware.check_bfloat16`), and the real run keeps the config's precision."""
    import torch

    from flowrl.hardware import native_bfloat16

    if torch.cuda.is_available() or native_bfloat16():
        return
    for section in ("sampling", "eval"):
        if isinstance(data.get(section), dict) and data[section].get("precision") == "bfloat16":
            data[section]["precision"] = "float32"
            notes.append(f"{section}.precision: float32 for the tiny epoch (this CPU has no bfloat16 hardware); the "
                         "real run keeps bfloat16")


def _dry_run(recipe, cfg, config: str, out, workdir, start: float) -> DryRunResult:
    from flowrl.config import from_dict, to_dict
    from flowrl.errors import user_errors
    from flowrl.run.harness import NO_USABLE_REWARD

    notes: list[str] = []
    needs: list[str] = []
    own_dir = None
    if workdir is None:
        own_dir = tempfile.TemporaryDirectory(prefix="flowrl-dry-run-")
        workdir = own_dir.name
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        model = getattr(cfg, "model", None)
        if model is not None and hasattr(model, "name") and hasattr(model, "path"):
            from flowrl.models.footprint import weights_status

            present, where = weights_status(model)
            needs.append(f"model weights: {'found: ' if present else 'MISSING: '}{where}")
        data = copy.deepcopy(to_dict(cfg))
        if isinstance(data.get("run"), dict):
            data["run"]["output_dir"] = str(workdir / "run")
        for key, value in _SHRINK:
            _set(data, key, value)
        if isinstance(data.get("log"), dict) and data["log"].get("backends"):
            notes.append(f"log.backends {data['log']['backends']} off (metrics.jsonl and plots only)")
            data["log"]["backends"] = []
        _tiny_model(data, workdir, notes)
        _cpu_precision(data, notes)
        probe = _prompts(data, workdir, notes, needs)
        _rewards(data, probe, notes, needs)
        module = importlib.import_module(recipe.main.__module__)
        hook = getattr(module, "dry_run_overrides", None)
        if hook is not None:
            notes.extend(hook(data, workdir) or [])
        tiny = from_dict(recipe.config_class, data)
        work = _epoch_work(cfg, getattr(module, "dry_run_work", None))
        out(f"flowrl train --dry-run: {config}: one epoch of the {recipe.main.__module__.rsplit('.', 1)[-1]} recipe "
            f"on a tiny model")
        for note in notes:
            out(f"  dry run: {note}")
        from flowrl.rl.setup import recorded_reference_declarations

        try:
            with recorded_reference_declarations() as declared:  # the recipe's reference use, for the estimate
                code = int(recipe.main(tiny) or 0)
            if code == NO_USABLE_REWARD:  # a random tiny model draws nothing a reward can tell apart
                out("  dry run: the tiny random model's rewards carried no learning signal (expected); the "
                    "epoch's plumbing ran")
                code = 0
        except user_errors() as err:
            out(f"flowrl train --dry-run: FAILED: {' '.join(str(err).split())}")
            code = getattr(err, "exit_code", 2)
        needs.extend(_memory(cfg, declared[0] if declared else None, getattr(module, "dry_run_memory", None)))
        seconds = time.perf_counter() - start
        out(f"flowrl train --dry-run: {'the tiny epoch ran' if code == 0 else 'the tiny epoch failed'} "
            f"({seconds:.0f} s). The real run needs:")
        for line in needs + [f"one epoch: {w}" for w in work]:
            out(f"  - {line}")
        return DryRunResult(exit_code=code, notes=notes, needs=needs, work=work, seconds=seconds,
                            output_dir=str(workdir / "run"))
    finally:
        if own_dir is not None:
            own_dir.cleanup()


def main(config: str, overrides: list[str]) -> int:
    """``flowrl train CONFIG --dry-run`` (called by ``flowrl.commands.train.main``)."""
    result = dry_run(config, overrides, out=lambda line: print(line, flush=True))
    return result["exit_code"]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1], sys.argv[2:]))
