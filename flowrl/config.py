"""Typed configs: dataclasses loaded from YAML plus ``a.b=c`` command-line overrides.

Every mistake a user can make in a config (an unknown or misspelt key, a value of the wrong type,
a value out of range, two settings that contradict each other) raises :class:`ConfigError`, whose
one-line message names the field path, the bad value and what is allowed.

Declaring a config::

    @dataclass
    class OptimConfig:
        lr: float = field(default=1e-4, metadata=bounds(gt=0))
        kind: Literal["adamw", "sgd"] = "adamw"

Fields may be ``int``, ``float``, ``bool``, ``str``, ``Literal[...]``, ``Optional[...]``,
``list[...]``, ``tuple[...]``, ``dict[str, ...]`` or nested dataclasses. ``metadata=bounds(...)``
adds numeric limits. A dataclass may define ``check(self)`` for consistency between fields; it
calls :func:`fail` with the offending field's name.
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "RunConfig",
    "LoraConfig",
    "RENAMED",
    "bounds",
    "fail",
    "from_dict",
    "to_dict",
    "load_yaml",
    "load_config_data",
    "config_value",
    "merge_config",
    "load_config",
    "apply_overrides",
    "parse_overrides",
    "save_config",
    "atomic_write_text",
    "convert_value",
    "checkable_type",
]


class ConfigError(FlowrlError, ValueError):
    """A config value is unknown, mistyped, out of range or inconsistent. The message is one line."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class _CheckFailure(Exception):
    def __init__(self, field_name: str, message: str):
        self.field_name = field_name
        self.message = message


def fail(field_name: str, message: str) -> typing.NoReturn:
    """Raise from a dataclass's ``check()``; the loader prefixes the field's full path."""
    raise _CheckFailure(field_name, message)


def bounds(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None) -> dict:
    """Field metadata with numeric limits, e.g. ``field(default=0.1, metadata=bounds(ge=0, le=1))``."""
    return {"bounds": {"ge": ge, "gt": gt, "le": le, "lt": lt}}


@dataclasses.dataclass
class StopOnConfig:
    """``run.stop_on``: stop early when a held-out measure has not improved for ``patience`` evaluations (while
    the training reward kept rising, with ``while_reward_rises``), keeping the best evaluation's checkpoint in
    ``checkpoints/best``: the over-optimisation guard (the proxy climbs, the gold falls)."""

    metric: str = "eval/shapes/accuracy"  # a key of the evaluation's metrics (eval/..., hack/...)
    mode: Literal["max", "min"] = "max"  # max: higher is better
    patience: int = dataclasses.field(default=3, metadata=bounds(ge=1, le=1000))  # evaluations without improvement
    min_delta: float = dataclasses.field(default=0.0, metadata=bounds(ge=0))  # what counts as an improvement
    # Stop only if the training reward's mean over those evaluations' epochs rose meanwhile (the hacking case);
    # false: stop on the held-out measure alone.
    while_reward_rises: bool = True

    def check(self) -> None:
        if not self.metric.startswith(("eval/", "hack/")):
            fail("metric", f"{self.metric!r} is not a held-out measure; name an evaluation metric such as "
                 "eval/shapes/accuracy or hack/accuracy")


@dataclasses.dataclass
class RunConfig:
    """The ``run`` section every run config has."""

    output_dir: str = "runs/default"
    seed: int = dataclasses.field(default=0, metadata=bounds(ge=0, lt=2**63))
    max_epochs: int = dataclasses.field(default=10, metadata=bounds(ge=0))
    # Continue from the newest checkpoint in output_dir/checkpoints (error if there is none).
    resume: bool = False
    # Start fresh in an output_dir that holds an earlier run, deleting that run's files (without it, and
    # without resume, such a folder is an error: nothing a user made is lost by accident).
    overwrite: bool = False
    # Training-time budget in minutes, evaluation excluded (None = unlimited). The run checkpoints and
    # stops cleanly when it is spent.
    max_minutes: float | None = dataclasses.field(default=None, metadata=bounds(gt=0))
    # What max_minutes, eval.every_minutes and time/train_min count: wall-clock time; this process's CPU
    # time (all its threads), which hardly depends on what else a physical machine runs; or reference CPU time,
    # the CPU time valued by a probe of the CPU's speed every 5 CPU-seconds (flowrl/run/calibration.py), the same
    # training on any CPU and on a virtual machine whose cores slow down when their neighbours are busy.
    clock: Literal["wall", "cpu", "reference"] = "wall"
    # Multiplies the measured time before it meets max_minutes, eval.every_minutes and time/train_min, so a
    # budget means the same training on a slower or faster CPU: a machine that runs the workload in 1.2x the
    # reference machine's time sets 1/1.2 (the benchmarks measure it: experiments/calibrate.py). 1 = as measured.
    clock_scale: float = dataclasses.field(default=1.0, metadata=bounds(gt=0, le=100))
    # torch.set_num_threads for the run (None: torch's default, one per core).
    threads: int | None = dataclasses.field(default=None, metadata=bounds(ge=1, le=1024))
    # Bitwise-reproducible kernels (slower); required for exact resume comparisons.
    deterministic: bool = False
    # Flush float32 denormals (|x| < 1.2e-38) to zero on the CPU (torch.set_flush_denormal). A saturated loss
    # (Diffusion-DPO at a large beta: sigmoid gradients ~ e^-logit) fills the backward pass with denormals, which
    # x86 CPUs compute ~100x slower: an epoch took 9-34 s instead of 7 with the same losses. No effect on GPUs.
    flush_denormal: bool = True
    # TF32 for float32 matmuls and convolutions on NVIDIA GPUs (Ampere and newer: A100, H100, RTX 30xx+):
    # torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32. Several times faster float32
    # matmuls with a 10-bit mantissa for the products (sums stay float32); bfloat16 compute is unaffected. false
    # keeps full float32 (e.g. to compare numbers bit for bit with another GPU run). No effect on CPUs.
    tf32: bool = True
    # Run health: stop (after a checkpoint of the last finite weights) when this many optimizer updates in a
    # row had a non-finite loss or gradient (each is skipped, not applied) ...
    max_nonfinite_updates: int = dataclasses.field(default=3, metadata=bounds(ge=1))
    # ... or when this many epochs in a row had only NaN rewards, or rewards equal within every group.
    max_degenerate_epochs: int = dataclasses.field(default=5, metadata=bounds(ge=1))
    # Early stop on a falling held-out measure, keeping the best checkpoint (None: off).
    stop_on: StopOnConfig | None = None
    # Where the run's tensors live: auto (the GPU accelerate assigns this process, else the CPU; a real-size model
    # that would land on the CPU is then an error naming the likely cause, flowrl/hardware.py), cpu (on purpose),
    # cuda (an error without a usable GPU) or another registered torch device type (mps; the tests' fake
    # accelerator, flowrl/testing/fake_accelerator.py).
    device: str = "auto"
    # How long a collective (all-reduce, gather, FSDP2's all-gather) waits for the slowest process before the run
    # fails with an error instead of hanging: long enough for the main process's own work between collectives (a
    # checkpoint, a LoRA export, an evaluation grid). torch's NCCL default is 10 minutes.
    collective_timeout_minutes: float = dataclasses.field(default=60.0, metadata=bounds(gt=0, le=24 * 60))

    def check(self) -> None:
        if self.resume and self.overwrite:
            fail("overwrite", "run.resume=true continues the run in output_dir and run.overwrite=true deletes it; "
                 "choose one")


@dataclasses.dataclass
class LoraConfig:
    """LoRA adapters (through peft) of a trained network: an image or video generator's denoiser
    (``model.lora`` of the image recipes, :mod:`flowrl.models`) or a token policy's language model (``model.lora`` of
    the VLM recipes, :mod:`flowrl.policies`). None in their place: full fine-tuning. The adapted weights start as
    each family's training scripts start them (the down projection Gaussian for generators, Kaiming-uniform for
    token policies; the up projection 0), so a new adapter leaves the network unchanged."""

    rank: int = dataclasses.field(default=32, metadata=bounds(ge=1))
    alpha: float = dataclasses.field(default=64.0, metadata=bounds(gt=0))  # the update is scaled by alpha / rank
    dropout: float = dataclasses.field(default=0.0, metadata=bounds(ge=0, lt=1))
    target_modules: list[str] = dataclasses.field(default_factory=list)  # empty: the network's default targets


# ----------------------------------------------------------------------------- conversion


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        inner = _describe(args[0]) if args else "any"
        return f"a list of {inner}"
    if origin is dict:
        args = typing.get_args(tp)
        return f"a mapping of str to {_describe(args[1]) if args else 'any'}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the type hint ``tp`` and return it converted (ints to floats, lists to tuples)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        real = [a for a in args if a is not type(None)]
        sections = [a for a in real if dataclasses.is_dataclass(a)]
        if len(real) == 1 or (isinstance(value, dict) and len(sections) == 1):
            return _convert(value, real[0] if len(real) == 1 else sections[0], path)  # its own, precise error
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError:
                continue
        raise ConfigError(path, f"got {_short(value)}; expected {_describe(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and not (isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed)):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(path, f"got {_short(value)}; expected {_describe(tp)}{hint}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(path, f"got {_short(value)}; expected {_describe(tp)}")
        return _build(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"got {_short(value)}; expected {_describe(tp)}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(path, f"got {_short(value)}; expected a list of {len(args)} items")
            items = [_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            inner = args[0] if args else Any
            items = [_convert(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"got {_short(value)}; expected {_describe(tp)}")
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        return {_convert(k, key_tp, f"{path}.{k}"): _convert(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):  # inf / nan would only surface later as NaN weights
                raise ConfigError(path, f"got {_short(value)}; expected a finite number")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(path, f"got {_short(value)}; expected {_describe(tp)}")


def convert_value(value: Any, tp: Any, path: str) -> Any:
    """``value`` checked against the type hint ``tp`` with the rules of config fields (ints become floats,
    lists tuples); raises :class:`ConfigError` naming ``path``, the value and what is expected."""
    return _convert(value, tp, path)


def checkable_type(tp: Any) -> bool:
    """``tp`` is built only from the kinds :func:`convert_value` understands (``int``, ``float``, ``bool``,
    ``str``, ``None``, ``Any``, ``Literal``, unions, ``list`` / ``tuple`` / ``dict`` of those)."""
    origin = typing.get_origin(tp)
    if tp in (int, float, bool, str, type(None), Any):
        return True
    if origin is Literal:
        return True
    if origin in (Union, types.UnionType, list, tuple, dict):
        return all(a is Ellipsis or checkable_type(a) for a in typing.get_args(tp))
    return False


def _check_bounds(value: Any, limits: dict, path: str) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    rules = {"ge": (lambda a, b: a >= b, ">="), "gt": (lambda a, b: a > b, ">"),
             "le": (lambda a, b: a <= b, "<="), "lt": (lambda a, b: a < b, "<")}
    violated = [f"{sym} {limit}" for key, (ok, sym) in rules.items()
                if (limit := limits.get(key)) is not None and not ok(value, limit)]
    if violated:
        allowed = " and ".join(f"{sym} {limit}" for key, (_, sym) in rules.items()
                               if (limit := limits.get(key)) is not None)
        raise ConfigError(path, f"got {_short(value)}; must be {allowed}")


#: Every config key flowrl renamed, ``{old dotted path: where it is now}`` (paths from the root of a recipe's config).
#: An old key is not migrated: it is an unknown key whose one-line error names its new place
#: (``train.adv_clip: unknown key: it is now advantage.clip``), so a config says one thing in one vocabulary.
RENAMED: dict[str, str] = {
    # One vocabulary (issue 48): one advantage clip, one meaning of `rloo` (a normaliser) and of `estimator` (an
    # advantage estimator of flowrl.core.estimators), `ema_decay` per optimizer step only.
    "train.adv_clip": "advantage.clip",
    "train.kl_adv_clip": "advantage.clip",
    "algorithm.adv_clip": "advantage.clip",
    "algorithm.estimator": "advantage.normalizer",
    "algorithm.std_scope": "advantage.std_scope",
    "algorithm.eps": "advantage.eps",
    "algorithm.turn_credit": "advantage.estimator",
    "algorithm.gamma": "advantage.gamma",
    "algorithm.step_weight": "advantage.step_weight",
    "train.elastic_reset.ema_decay": "train.elastic_reset.decay_per_epoch",
    # Renamed before 0.1.0.
    "threads": "run.threads",
    "clock": "run.clock",
    "checkpoint_minutes": "checkpoint.every_minutes",
    "algorithm.kl_beta": "train.kl_coef",
    "algorithm.clip_low": "train.clip_range",
    "algorithm.clip_high": "train.clip_range_high",
    "train.kl_beta": "train.kl_coef",
    "train.kl_beta_units": "train.kl_coef_units",
    "train.ema": "train.ema_snapshot",
    "train.sampler": "train.rollout_snapshot",
}


def _unknown_key(key_path: str, valid: list[str], source: str | None = None) -> ConfigError:
    """The one-line error of an unknown key (``source``: the YAML file it is in): where a renamed key is now
    (:data:`RENAMED`), else the closest valid key and the valid ones."""
    where = f" in {source}" if source is not None else ""
    if key_path in RENAMED:
        return ConfigError(key_path, f"unknown key{where}: it is now {RENAMED[key_path]}")
    close = difflib.get_close_matches(key_path.rpartition(".")[2], valid, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    listed = "the base config has" if source is not None else "valid keys"
    return ConfigError(key_path, f"unknown key{where}{hint}; {listed}: {', '.join(valid)}")


def _build(cls: type[T], data: dict, path: str) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in fields:
            raise _unknown_key(key_path, list(fields))
        value = _convert(value, hints[key], key_path)
        _check_bounds(value, fields[key].metadata.get("bounds", {}), key_path)
        kwargs[key] = value
    try:
        obj = cls(**kwargs)
    except TypeError as err:  # a required field is missing
        missing = [n for n, f in fields.items() if n not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        raise ConfigError(path or "<config>", f"missing required key(s): {', '.join(missing)}") from err
    check = getattr(obj, "check", None)
    if callable(check):
        try:
            check()
        except _CheckFailure as failure:
            raise ConfigError(f"{path}.{failure.field_name}" if path else failure.field_name,
                              failure.message) from None
    return obj


def from_dict(cls: type[T], data: dict | None) -> T:
    """Build and validate the dataclass ``cls`` from a plain mapping (e.g. parsed YAML)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("<config>", f"expected a mapping at the top level, got {_short(data)}")
    return _build(cls, data, "")


def to_dict(obj: Any) -> Any:
    """Plain (YAML-safe) data of a config dataclass: tuples become lists."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- files and overrides


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping; a missing, unreadable, binary or malformed file is a one-line ConfigError."""
    path = Path(path)
    fix = "give a YAML config file such as configs/shapes/flow_grpo.yaml"
    if path.is_dir():
        raise ConfigError("<config>", f"config file {str(path)!r} is a folder; {fix}")
    if not path.is_file():
        raise ConfigError("<config>", f"config file {str(path)!r} does not exist")
    try:
        size = path.stat().st_size
        if size > 16 * 2 ** 20:  # configs are a few kB; this is some other file
            raise ConfigError("<config>", f"{path} is {size} bytes, too large for a config; {fix}")
        data_bytes = path.read_bytes()
    except OSError as err:
        raise ConfigError("<config>", f"cannot read {path} ({err.strerror or err}); check its permissions") from None
    try:
        text = data_bytes.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("<config>", f"{path} is not a text file (byte 0x{data_bytes[err.start]:02x} at offset "
                                      f"{err.start} is not UTF-8); {fix}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError("<config>", f"{path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    except RecursionError:
        raise ConfigError("<config>", f"{path} is nested too deeply to be a config; {fix}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("<config>", f"{path} must hold a mapping at the top level")
    return data


def _section_type(tp: Any) -> type | None:
    """The dataclass of a field typed as a dataclass or ``Optional[dataclass]`` (a mergeable section)."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return sections[0] if len(sections) == 1 else None
    return None


def merge_config(base: dict, override: dict, cls: type | None, *, source: str = "", path: str = "",
                 extra_keys: tuple[str, ...] = ()) -> dict:
    """``override`` deep-merged over ``base``: sections (dataclass-typed fields) merge key by key; every
    other value (numbers, lists, open mappings such as ``reward.train``) replaces the base's.

    Args:
        base / override: parsed YAML mappings.
        cls: the config dataclass of this level (its fields decide what is a section); None merges blindly.
        source: the file ``override`` came from (named in errors).
        path: the dotted path of this level (named in errors).
        extra_keys: top-level keys that are not part of ``cls`` (e.g. ``recipe``).

    Raises:
        ConfigError: ``override`` has a key ``cls`` does not have.
    """
    out = dict(base)
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}
    hints = typing.get_type_hints(cls) if cls is not None else {}
    for key, value in override.items():
        key_path = f"{path}.{key}" if path else str(key)
        if cls is not None and key not in fields and not (not path and key in extra_keys):
            raise _unknown_key(key_path, list(fields), source)
        section = _section_type(hints[key]) if key in hints else None
        if isinstance(value, dict) and isinstance(out.get(key), dict) and (section is not None or cls is None):
            out[key] = merge_config(out[key], value, section, source=source, path=key_path)
        else:
            out[key] = value
    return out


def _base_chain(path: Path, _stack: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    """``[(file, its own keys), ...]`` in merge order: ``path``'s bases (each with its own bases first), then
    ``path`` itself. ``base:`` is one file or a list of files, merged left to right; a file reached twice (two
    bases sharing a base) is merged once, at its first place, so a later base never resets what an earlier
    one changed."""
    resolved = path.resolve()
    if resolved in _stack:
        cycle = " -> ".join(str(p) for p in _stack + (resolved,))
        raise ConfigError("base", f"the base chain of {_stack[0]} loops: {cycle}; remove one of the base: keys")
    data = load_yaml(path)
    raw = data.pop("base", None)
    bases = [] if raw is None else [raw] if isinstance(raw, str) else raw
    if not isinstance(bases, list) or (raw is not None and not bases) or not all(
            isinstance(b, str) and b.strip() for b in bases):
        raise ConfigError("base", f"{path}: base must be a path to a YAML file (relative to the file) or a list "
                          f"of them, got {_short(bases)}")
    chain: list[tuple[Path, dict]] = []
    seen: set[Path] = set()
    for base in bases:
        nxt = path.parent / base
        if not nxt.is_file():
            raise ConfigError("base", f"{path}: base file {base!r} does not exist (looked for {nxt})")
        for file, own in _base_chain(nxt, _stack + (resolved,)):
            if file.resolve() not in seen:
                seen.add(file.resolve())
                chain.append((file, own))
    return chain + [(path, data)]


def load_config_data(path: str | Path, cls: type | None = None, *, extra_keys: tuple[str, ...] = ()) -> dict:
    """The YAML mapping of ``path`` with its ``base:`` files merged underneath (:func:`merge_config`).

    A config may name ``base: other.yaml`` or ``base: [a.yaml, b.yaml]`` (relative to itself, merged left to
    right) and keep only what differs; bases may have bases. A missing base, a cycle, or a key the config ``cls``
    does not have is a one-line :class:`ConfigError`. ``extra_keys`` are top-level keys outside ``cls`` (e.g.
    ``recipe``).
    """
    data: dict = {}
    for file, own in _base_chain(Path(path)):
        data = merge_config(data, own, cls, source=str(file), extra_keys=extra_keys)
    return data


def config_value(path: str | Path, key: str) -> Any:
    """A top-level key of a config, following its ``base:`` chain (e.g. the ``recipe`` it runs)."""
    value = None
    for _, own in _base_chain(Path(path)):
        value = own.get(key, value)
    return value


def parse_overrides(items: list[str]) -> list[tuple[list[str], Any]]:
    """Parse ``a.b=c`` strings; values are read as YAML scalars/lists (``lr=1e-4``, ``steps=[1,2]``)."""
    parsed = []
    for item in items:
        if "=" not in item:
            raise ConfigError(item, "an override must look like key.path=value (e.g. run.seed=3)")
        key, raw = item.split("=", 1)
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(item, "an override must look like key.path=value (e.g. run.seed=3)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        parsed.append((key.split("."), value))
    return parsed


def apply_overrides(data: dict, items: list[str]) -> dict:
    """Return a copy of ``data`` with ``a.b=c`` overrides applied (keys are validated later, by :func:`from_dict`)."""
    import copy

    data = copy.deepcopy(data)
    for keys, value in parse_overrides(items):
        node = data
        for i, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                raise ConfigError(".".join(keys[: i + 1]), f"is {_short(child)}, not a section; cannot set "
                                  f"{'.'.join(keys)}")
            node = child
        node[keys[-1]] = value
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None,
                *, drop_keys: tuple[str, ...] = ()) -> T:
    """Load ``cls`` from a YAML file (optional) plus overrides.

    Args:
        cls: the config dataclass.
        path: YAML file; ``None`` starts from the dataclass defaults.
        overrides: ``["a.b=c", ...]`` applied after the file.
        drop_keys: top-level keys consumed by the caller (e.g. ``recipe``) and not part of ``cls``.
    """
    data = load_config_data(path, cls, extra_keys=drop_keys) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    for key in drop_keys:
        data.pop(key, None)
    return from_dict(cls, data)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically: a reader (or a kill half-way) sees the old or the new file,
    never a truncated one."""
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_config(obj: Any, path: str | Path, extra: dict | None = None) -> None:
    """Write the resolved config as YAML (``extra`` keys, such as ``recipe``, come first), atomically."""
    data = dict(extra or {})
    data.update(to_dict(obj))
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))
