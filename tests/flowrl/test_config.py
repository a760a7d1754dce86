"""The typed config loader: every mistake is one clear line naming the field, the value and what is allowed."""

from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from flowrl.config import (ConfigError, RunConfig, apply_overrides, bounds, fail, from_dict, load_config,
                           save_config, to_dict)


@dataclass
class Optim:
    lr: float = field(default=1e-4, metadata=bounds(gt=0))
    kind: Literal["adamw", "sgd"] = "adamw"
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass
class Cfg:
    run: RunConfig = field(default_factory=RunConfig)
    optim: Optim = field(default_factory=Optim)
    steps: list[int] = field(default_factory=lambda: [1, 2])
    weights: dict[str, float] = field(default_factory=dict)
    note: Optional[str] = None
    clip: float = field(default=0.2, metadata=bounds(ge=0, lt=1))

    def check(self):
        if self.optim.kind == "sgd" and self.optim.lr > 1:
            fail("optim.lr", f"{self.optim.lr} is too large for sgd (must be <= 1)")


def one_line(err: ConfigError) -> str:
    text = str(err)
    assert "\n" not in text
    return text


def test_defaults_and_nested_values():
    cfg = from_dict(Cfg, {"optim": {"lr": 3e-4, "betas": [0.8, 0.9]}, "run": {"seed": 7}})
    assert cfg.optim.lr == 3e-4 and cfg.optim.betas == (0.8, 0.9) and cfg.run.seed == 7
    assert cfg.run.output_dir == "runs/default" and cfg.steps == [1, 2]


def test_misspelt_key_names_path_and_suggests():
    with pytest.raises(ConfigError) as info:
        from_dict(Cfg, {"optim": {"lrr": 1e-3}})
    text = one_line(info.value)
    assert text.startswith("optim.lrr: unknown key")
    assert "did you mean 'lr'" in text and "valid keys: lr, kind, betas" in text


def test_wrong_type_names_value_and_expected_type():
    with pytest.raises(ConfigError) as info:
        from_dict(Cfg, {"run": {"seed": "seven"}})
    assert one_line(info.value) == "run.seed: got 'seven'; expected an integer"
    with pytest.raises(ConfigError, match=r"^run\.resume: got 1; expected true or false$"):
        from_dict(Cfg, {"run": {"resume": 1}})
    with pytest.raises(ConfigError, match=r"^steps\[1\]: got 'x'; expected an integer$"):
        from_dict(Cfg, {"steps": [1, "x"]})


def test_out_of_range_and_choices():
    with pytest.raises(ConfigError) as info:
        from_dict(Cfg, {"clip": 1.5})
    assert one_line(info.value) == "clip: got 1.5; must be >= 0 and < 1"
    with pytest.raises(ConfigError) as info:
        from_dict(Cfg, {"optim": {"kind": "adam"}})
    text = one_line(info.value)
    assert text.startswith("optim.kind: got 'adam'; expected one of 'adamw', 'sgd'") and "did you mean 'adamw'" in text
    with pytest.raises(ConfigError, match=r"^run\.max_epochs: got -1; must be >= 0$"):
        from_dict(Cfg, {"run": {"max_epochs": -1}})


def test_consistency_check_names_field():
    with pytest.raises(ConfigError, match=r"^optim\.lr: 2\.0 is too large for sgd"):
        from_dict(Cfg, {"optim": {"kind": "sgd", "lr": 2}})


def test_yaml_scientific_notation_string_is_a_float():
    # YAML 1.1 (PyYAML) reads "1e-4" (no dot) as a string; configs must still accept it.
    assert from_dict(Cfg, {"optim": {"lr": "1e-4"}}).optim.lr == pytest.approx(1e-4)


def test_overrides_and_files(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 0.001\nrun:\n  seed: 1\n")
    cfg = load_config(Cfg, path, ["run.seed=5", "optim.kind=sgd", "steps=[3,4]", "weights.a=0.5", "note=hi"])
    assert (cfg.run.seed, cfg.optim.kind, cfg.steps, cfg.weights, cfg.note) == (5, "sgd", [3, 4], {"a": 0.5}, "hi")
    assert cfg.optim.lr == 0.001
    with pytest.raises(ConfigError, match="override must look like"):
        apply_overrides({}, ["run.seed"])
    with pytest.raises(ConfigError, match=r"^run\.sed: unknown key \(did you mean 'seed'\?\)"):
        load_config(Cfg, path, ["run.sed=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Cfg, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(Cfg, bad)


def test_save_round_trip(tmp_path):
    cfg = from_dict(Cfg, {"optim": {"betas": [0.5, 0.6]}, "weights": {"x": 2.0}})
    save_config(cfg, tmp_path / "out.yaml", extra={"recipe": "demo"})
    again = load_config(Cfg, tmp_path / "out.yaml", drop_keys=("recipe",))
    assert to_dict(again) == to_dict(cfg)


def test_cpu_clock_counts_this_processs_cpu_time_not_sleep():
    import time

    from flowrl.run.runtime import CpuDeadline, Deadline, make_deadline

    cpu, wall = make_deadline("cpu", 1.0), make_deadline("wall", 1.0)
    assert type(cpu) is CpuDeadline and type(wall) is Deadline
    time.sleep(0.3)  # waiting (another job holding the core) costs wall time, not CPU time
    assert wall.elapsed_minutes() * 60 >= 0.29
    assert cpu.elapsed_minutes() * 60 < 0.1
    start = time.process_time()
    while time.process_time() - start < 0.3:  # work
        pass
    assert cpu.elapsed_minutes() * 60 >= 0.29
    with cpu.excluded():  # evaluation does not count
        start = time.process_time()
        while time.process_time() - start < 0.3:
            pass
    assert cpu.elapsed_minutes() * 60 < 0.5
    assert make_deadline("cpu", None, already_spent=2.0).elapsed_minutes() >= 2.0


def test_clock_scale_turns_measured_time_into_reference_minutes():
    import time

    from flowrl.run.runtime import make_deadline

    # A CPU at half the reference speed (scale 0.5) needs twice the CPU time for the same budget; earlier
    # sessions' minutes (already scaled) are not scaled again.
    slow, plain = make_deadline("cpu", 1.0, already_spent=0.25, scale=0.5), make_deadline("cpu", 1.0, already_spent=0.25)
    start = time.process_time()
    while time.process_time() - start < 0.6:
        pass
    slow_s, plain_s = (slow.elapsed_minutes() - 0.25) * 60, (plain.elapsed_minutes() - 0.25) * 60
    assert 0.59 <= plain_s < 0.8 and abs(slow_s - plain_s / 2) < 0.02
    wall = make_deadline("wall", 1.0, scale=3.0)
    time.sleep(0.2)
    assert wall.elapsed_minutes() * 60 >= 0.59


def _busy(seconds: float) -> None:
    import time

    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


def test_reference_clock_values_cpu_time_by_the_probe_and_does_not_count_the_probes():
    from flowrl.run.runtime import ReferenceDeadline

    # A probe that reports 0.2 s, then 0.6 s twice (the CPU slowed to a third), and burns 0.1 CPU-s each time.
    reports = iter([0.2, 0.6, 0.6])

    def probe() -> float:
        _busy(0.1)
        return next(reports)

    clock = ReferenceDeadline(0.52, already_spent=0.5, scale=2.0, probe=probe, reference_seconds=0.4,
                              probe_every=0.3, timer=False)  # probes when passed() is asked
    assert clock.probes == [0.2] and clock.rate() == 4.0  # 2 x 0.4 / 0.2; the first probe is not counted
    assert clock.elapsed_minutes() * 60 < 30.05
    _busy(0.2)
    assert not clock.passed() and clock.probes == [0.2]  # 0.2 CPU-s < probe_every: no probe yet
    assert 0.79 <= (clock.elapsed_minutes() - 0.5) * 60 < 0.9  # 0.2 s at the last probe's rate, 4
    _busy(0.15)
    assert not clock.passed()  # 0.35 CPU-s since the first probe: probe again (0.6 s)
    assert clock.probes == [0.2, 0.6] and abs(clock.rate() - 2 * 0.4 / 0.6) < 1e-12
    # The stretch between the probes counts 2 x 0.4 / mean(0.2, 0.6) = 2 reference s per CPU-s; the probe's
    # own 0.1 CPU-s is excluded.
    counted = clock.counted_minutes * 60
    assert 0.69 <= counted < 0.8 and abs((clock.elapsed_minutes() - 0.5) * 60 - counted) < 0.02
    _busy(1.0)  # at 2 x 0.4 / 0.6 reference s per CPU-s: 0.5 min + (0.7 + 1.33) s passes 0.52 min
    assert clock.passed() and clock.probes == [0.2, 0.6, 0.6]


def test_the_reference_clock_probes_on_a_cpu_time_timer_but_not_while_evaluating():
    import signal

    from flowrl.run.runtime import ReferenceDeadline

    clock = ReferenceDeadline(None, probe=lambda: 0.2, reference_seconds=0.2, probe_every=0.1)
    try:
        _busy(0.55)  # pure Python work: the SIGPROF timer fires every 0.1 CPU-s and the handler probes
        assert 4 <= len(clock.probes) <= 7
        with clock.excluded():
            before = len(clock.probes)
            _busy(0.3)
            assert len(clock.probes) == before
        assert abs(clock.elapsed_minutes() * 60 - 0.55) < 0.1  # rate 1: the training CPU time, evaluation out
    finally:
        clock.close()
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    after = len(clock.probes)
    _busy(0.25)
    assert len(clock.probes) == after


def test_the_reference_clock_probe_measures_the_shapes_model_without_touching_the_run():
    import torch

    from flowrl.run.runtime import ReferenceDeadline, make_deadline

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    clock = make_deadline("reference", 10.0)
    assert type(clock) is ReferenceDeadline
    assert torch.equal(torch.rand(3), expected) and torch.get_num_threads() == threads
    assert 0.005 < clock.probes[0] < 30 and clock.elapsed_minutes() < 0.01  # building and probing not counted
    with torch.inference_mode():  # the timer may fire in the middle of sampling: the probe still trains
        assert clock.probe() > 0
    clock.close()


def test_a_renamed_key_keeps_working_with_a_warning(capsys):
    from flowrl.config import ConfigError, from_dict
    from flowrl.recipes.vlm_sft import Config

    cfg = from_dict(Config, {"clock": "cpu", "threads": 1})
    assert cfg.run.clock == "cpu" and cfg.run.threads == 1
    err = capsys.readouterr().err
    assert "'clock' is deprecated; use 'run.clock'" in err
    assert from_dict(Config, {"clock": "cpu", "run": {"clock": "cpu"}}).run.clock == "cpu"  # same value twice is fine
    with pytest.raises(ConfigError, match="set twice"):
        from_dict(Config, {"clock": "cpu", "run": {"clock": "wall"}})


def test_vlm_grpo_old_clip_and_kl_keys_move_to_train_with_a_warning(capsys, tmp_path):
    """``algorithm.kl_beta`` / ``clip_low`` / ``clip_high`` (a section's keys moved to another section) keep
    working in a file, in a ``a.b=c`` override and in a plain mapping."""
    from flowrl.config import ConfigError, from_dict
    from flowrl.recipes.vlm_grpo import Config
    from pathlib import Path

    from flowrl.commands.train import load_recipe_config

    cfg = from_dict(Config, {"algorithm": {"kl": "k3", "kl_beta": 0.05, "clip_low": 0.1, "clip_high": 0.3}})
    assert (cfg.train.kl_coef, cfg.train.clip_range, cfg.train.clip_range_high) == (0.05, 0.1, 0.3)
    assert cfg.algorithm.resolved(cfg.train).clip_range_high == 0.3
    assert cfg.algorithm.resolved(cfg.train).clip_range == 0.1
    err = capsys.readouterr().err
    assert "'algorithm.kl_beta' is deprecated; use 'train.kl_coef'" in err
    with pytest.raises(ConfigError, match="set twice"):
        from_dict(Config, {"algorithm": {"kl_beta": 0.05}, "train": {"kl_coef": 0.1}})
    config = tmp_path / "old.yaml"
    config.write_text("base: " + str(Path(__file__).resolve().parents[2] / "configs/vlm/shapes_vqa_grpo.yaml")
                      + "\nalgorithm:\n  kl: k3\n  kl_beta: 0.02\n  clip_high: 0.28\n")
    _, cfg = load_recipe_config(str(config), ["algorithm.clip_low=0.15"])
    assert (cfg.train.kl_coef, cfg.train.clip_range, cfg.train.clip_range_high) == (0.02, 0.15, 0.28)
    assert cfg.algorithm.resolved(cfg.train).clip_range == 0.15
    # Unset: the variant's defaults.
    assert from_dict(Config, {"algorithm": {"variant": "dapo"}}).algorithm.resolved().clip_range_high == 0.28
