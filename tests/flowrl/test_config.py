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
    slow = make_deadline("cpu", 1.0, already_spent=0.25, scale=0.5)
    plain = make_deadline("cpu", 1.0, already_spent=0.25)
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


def test_a_renamed_key_is_a_one_line_error_naming_its_new_place(tmp_path):
    """An old key is not migrated: the unknown-key error reads the one rename table (flowrl.config.RENAMED) and
    says where the key is now, in a plain mapping, in an override and in a YAML file (and under its base)."""
    from pathlib import Path

    from flowrl.commands.train import load_recipe_config
    from flowrl.config import RENAMED
    from flowrl.recipes import nft, vlm_grpo, vlm_sft

    root = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError) as info:
        from_dict(nft.Config, {"train": {"adv_clip": 5.0}})
    assert str(info.value) == "train.adv_clip: unknown key: it is now advantage.clip"
    with pytest.raises(ConfigError, match=r"^clock: unknown key: it is now run.clock$"):
        from_dict(vlm_sft.Config, {"clock": "cpu"})
    with pytest.raises(ConfigError, match=r"^algorithm.turn_credit: unknown key: it is now advantage.estimator$"):
        load_recipe_config(str(root / "configs/vlm/shapes_zoom_gigpo.yaml"), ["algorithm.turn_credit=gigpo"])
    with pytest.raises(ConfigError, match=r"^train.elastic_reset.ema_decay: unknown key: it is now "
                                          r"train.elastic_reset.decay_per_epoch$"):
        load_recipe_config(str(root / "configs/shapes/flow_grpo.yaml"),
                           ["train.elastic_reset={every_epochs: 3, ema_decay: 0.5}"])
    old = tmp_path / "old.yaml"
    old.write_text(f"base: {root / 'configs/vlm/shapes_vqa_grpo.yaml'}\nalgorithm:\n  kl: k3\n  kl_beta: 0.02\n")
    with pytest.raises(ConfigError, match=r"^algorithm.kl_beta: unknown key in .*old.yaml: it is now train.kl_coef$"):
        load_recipe_config(str(old), [])
    # The new names load, and every old name's new place is a key of some recipe's config.
    cfg = from_dict(vlm_grpo.Config, {"algorithm": {"kl": "k3"}, "advantage": {"clip": 3.0, "normalizer": "rloo"},
                                      "train": {"kl_coef": 0.02, "clip_range": 0.1}})
    assert (cfg.advantage.clip, cfg.variant().normalizer, cfg.variant().clip_range) == (3.0, "rloo", 0.1)
    assert {"train.adv_clip", "train.kl_adv_clip", "algorithm.adv_clip"} <= set(RENAMED)
    assert {RENAMED[k] for k in ("train.adv_clip", "train.kl_adv_clip", "algorithm.adv_clip")} == {"advantage.clip"}


def test_the_rename_table_points_at_keys_that_exist():
    import dataclasses
    import typing

    from flowrl.config import RENAMED, _section_type
    from flowrl.recipes import RECIPES

    def has(cls, dotted: str) -> bool:
        for key in dotted.split("."):
            fields = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}
            if key not in fields:
                return False
            cls = _section_type(typing.get_type_hints(cls)[key])
        return True

    configs = [RECIPES.get(name).config_class for name in RECIPES.names()]
    for old, new in RENAMED.items():
        assert any(has(c, new.split(" ")[0]) for c in configs), f"{old} -> {new}: no recipe has {new}"
        assert not any(has(c, old) for c in configs), f"{old} is still a key"


def test_vlm_variants_fill_what_the_config_leaves_unset():
    from flowrl.recipes.vlm_grpo import Config

    # Unset: the variant's defaults; `rloo` is a normaliser in both the VLM and the image recipes.
    assert from_dict(Config, {"algorithm": {"variant": "dapo"}}).variant().clip_range_high == 0.28
    assert from_dict(Config, {"algorithm": {"variant": "rloo"}}).variant().normalizer == "rloo"
    assert from_dict(Config, {"algorithm": {"variant": "rloo"},
                              "advantage": {"normalizer": "group"}}).variant().normalizer == "group"


def test_one_advantage_section_for_images_and_the_vlm_refuses_what_its_loop_cannot_do():
    """Images and the VLM read one ``AdvantageConfig``; each recipe refuses an estimator its loop cannot feed, a
    normaliser it lacks, and an option the chosen estimator would silently ignore."""
    from flowrl.recipes import dgpo, flow_grpo, vlm_grpo
    from flowrl.rl.epoch_advantages import AdvantageConfig, advantage_options

    assert type(vlm_grpo.Config().advantage) is type(flow_grpo.Config().advantage) is AdvantageConfig
    # Unset normaliser / std scope: group / group for images (dgpo's default scope is batch), the variant's for VLM.
    assert {k: advantage_options(flow_grpo.Config().advantage)[k] for k in ("normalizer", "std_scope")} == {
        "normalizer": "group", "std_scope": "group"}
    assert advantage_options(dgpo.Config().advantage)["std_scope"] == "batch"
    assert from_dict(vlm_grpo.Config, {"algorithm": {"variant": "dr_grpo"}}).variant().std_scope == "none"
    # Turn-level credit loads for the VLM and is refused by the image loop (and the reverse).
    assert from_dict(vlm_grpo.Config, {"advantage": {"estimator": "gigpo", "step_weight": 0.5}}).advantage.gamma == 0.95
    with pytest.raises(ConfigError, match=r"^advantage.estimator: got 'gigpo'; expected one of .*tp_grpo.* \(the "
                                          r"estimators of denoising trajectories\)$"):
        from_dict(flow_grpo.Config, {"advantage": {"estimator": "gigpo"}})
    with pytest.raises(ConfigError, match=r"^advantage.estimator: got 'tp_grpo'; .*trloo.* \(the estimators of VLM "
                                          r"episodes\)$"):
        from_dict(vlm_grpo.Config, {"advantage": {"estimator": "tp_grpo"}})
    with pytest.raises(ConfigError, match=r"^advantage.normalizer: got 'per_prompt'; the VLM episodes support "
                                          r"group, rloo$"):
        from_dict(vlm_grpo.Config, {"advantage": {"normalizer": "per_prompt"}})
    with pytest.raises(ConfigError, match=r"^advantage.shuffle: the control runs are built for the image loop"):
        from_dict(vlm_grpo.Config, {"advantage": {"shuffle": True}})
    with pytest.raises(ConfigError, match=r"^advantage.gamma: is the discount of turn-level credit \(gigpo, "
                                          r"turn_return, trloo\); estimator 'outcome' would ignore it"):
        from_dict(vlm_grpo.Config, {"advantage": {"gamma": 0.5}})
    with pytest.raises(ConfigError, match=r"^advantage.cosine_window: is cosine credit's smoothing window"):
        from_dict(dgpo.Config, {"advantage": {"cosine_window": 4}})
    with pytest.raises(ConfigError, match=r"^advantage.per_prompt_buffer: .* apply to normalizer: per_prompt only$"):
        from_dict(flow_grpo.Config, {"advantage": {"per_prompt_buffer": 8, "per_prompt_min_count": 4}})
    with pytest.raises(ConfigError, match=r"^advantage.estimator: got 'nope'; expected one of "):
        from_dict(dgpo.Config, {"advantage": {"estimator": "nope"}})
