"""Every YAML shipped under configs/ loads: recipe configs through flowrl's typed loader (which rejects
unknown keys and bad values), accelerate configs through accelerate's own loader."""

from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from flowrl.commands.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[1]
# Fragments that configs compose (`base:`): model bases under <family>/base/, task bases under tasks/.
FRAGMENT_DIRS = ("base", "tasks")
ALL_YAMLS = sorted((ROOT / "configs").rglob("*.yaml"))
YAMLS = [p for p in ALL_YAMLS if p.parent.name not in FRAGMENT_DIRS]
FRAGMENTS = [p for p in ALL_YAMLS if p.parent.name in FRAGMENT_DIRS]


def test_there_are_configs_of_every_kind():
    names = {p.relative_to(ROOT / "configs").as_posix() for p in YAMLS}
    for required in ("shapes/pretrain.yaml", "shapes/flow_grpo.yaml", "shapes/demo.yaml", "sd3/flow_grpo_geneval.yaml",
                     "sd3/flow_grpo_ocr.yaml", "sd3/flow_grpo_pickscore.yaml", "flux/flow_grpo_pickscore.yaml",
                     "accelerate/cpu_2proc.yaml", "accelerate/multi_gpu.yaml", "accelerate/multi_node.yaml",
                     "accelerate/fsdp.yaml", "accelerate/zero2.yaml", "vlm/shapes_vqa_sft.yaml",
                     "vlm/shapes_vqa_grpo.yaml", "vlm/shapes_zoom_gigpo.yaml", "vlm/qwen2_5_vl_3b_grpo.yaml"):
        assert required in names


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.relative_to(ROOT / "configs").as_posix())
def test_config_loads(path):
    if path.parent.name == "accelerate":
        config = load_config_from_file(str(path))
        assert config.num_processes >= 1
        return
    recipe, cfg = load_recipe_config(str(path), [])
    assert cfg.run.output_dir and cfg.run.max_epochs >= 1
    assert isinstance(cfg.run.seed, int)


def test_make_demo_runs_the_shipped_dgpo_at_the_comparisons_beta():
    """``make demo`` is DGPO as shipped with the comparison's winning beta (10, against the config's 100): the same
    recipe, rollouts, reward and budget, nothing else changed but where the run goes."""
    from flowrl.config import to_dict

    assert "configs/shapes/demo.yaml" in (ROOT / "Makefile").read_text()
    dgpo_recipe, dgpo = load_recipe_config(str(ROOT / "configs/shapes/dgpo.yaml"), [])
    demo_recipe, demo = load_recipe_config(str(ROOT / "configs/shapes/demo.yaml"), [])
    assert demo_recipe.main is dgpo_recipe.main and (demo.train.beta, dgpo.train.beta) == (10.0, 100.0)
    a, b = to_dict(dgpo), to_dict(demo)
    assert {k for k in a if a[k] != b[k]} == {"run", "train"}
    assert {k for k in a["run"] if a["run"][k] != b["run"][k]} == {"output_dir"}
    assert {k for k in a["train"] if a["train"][k] != b["train"][k]} == {"beta"}
    assert (demo.sampling.precision, demo.eval.precision, demo.run.clock, demo.run.max_minutes) == (
        "float32", "float32", "wall", 30.0)


def test_variants_keep_only_what_differs_and_resolve_to_their_base():
    """tp_grpo / cosine_grpo are the main job with another estimator: nothing else may differ."""
    from flowrl.config import to_dict

    _, main = load_recipe_config(str(ROOT / "configs/shapes/flow_grpo.yaml"), [])
    for variant, estimator in (("tp_grpo", "tp_grpo"), ("cosine_grpo", "cosine")):
        text = (ROOT / f"configs/shapes/{variant}.yaml").read_text()
        assert "base: flow_grpo.yaml" in text and "sampling:" not in text
        _, cfg = load_recipe_config(str(ROOT / f"configs/shapes/{variant}.yaml"), [])
        assert cfg.advantage.estimator == estimator
        a, b = to_dict(main), to_dict(cfg)
        assert {k for k in a if a[k] != b[k]} == {"run", "advantage"}
        assert {k for k in a["run"] if a["run"][k] != b["run"][k]} == {"output_dir"}
    _, ocr = load_recipe_config(str(ROOT / "configs/sd3/flow_grpo_ocr.yaml"), [])
    assert ocr.reward.train == {"ocr": 1.0} and ocr.train.kl_coef == 0.04  # open mappings replace, not merge
    assert ocr.model.lora.rank == 32 and ocr.train.cfg_grad == "cond_only"  # inherited


def test_the_guarded_main_job_differs_from_the_main_job_only_by_its_guard():
    """flow_grpo_artifact.yaml is the hacking benchmark's ``artifact_0.5+base_tail``: the main job plus the
    artifact reward at 0.5 and the base model's last 4 steps, nothing else."""
    from flowrl.config import to_dict

    _, main = load_recipe_config(str(ROOT / "configs/shapes/flow_grpo.yaml"), [])
    _, guarded = load_recipe_config(str(ROOT / "configs/shapes/flow_grpo_artifact.yaml"), [])
    a, b = to_dict(main), to_dict(guarded)
    assert {k for k in a if a[k] != b[k]} == {"run", "sampling", "reward"}
    assert {k for k in a["run"] if a["run"][k] != b["run"][k]} == {"output_dir"}
    assert {k for k in a["sampling"] if a["sampling"][k] != b["sampling"][k]} == {"base_last_steps"}
    assert (main.sampling.base_last_steps, guarded.sampling.base_last_steps) == (0, 4)
    assert {k for k in a["reward"] if a["reward"][k] != b["reward"][k]} == {"train"}
    assert guarded.reward.train == {"shapes": 1.0,
                                    "artifact": {"weight": 0.5, "kwargs": {"path": "runs/artifact_model"}}}


def test_base_errors_are_one_line(tmp_path):
    from flowrl.config import ConfigError

    base = tmp_path / "base.yaml"
    base.write_text("recipe: flow_grpo\nsampling: {group_size: 4}\n")
    (tmp_path / "ok.yaml").write_text("base: base.yaml\nsampling: {groups_per_epoch: 3}\n")
    _, cfg = load_recipe_config(str(tmp_path / "ok.yaml"), ["sampling.batch_size=5"])
    assert (cfg.sampling.group_size, cfg.sampling.groups_per_epoch, cfg.sampling.batch_size) == (4, 3, 5)
    (tmp_path / "missing.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"^base: .*missing.yaml: base file 'nowhere.yaml' does not exist"):
        load_recipe_config(str(tmp_path / "missing.yaml"), [])
    (tmp_path / "a.yaml").write_text("base: b.yaml\nrecipe: flow_grpo\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"^base: the base chain of .*a.yaml loops: .*a.yaml -> .*b.yaml -> "):
        load_recipe_config(str(tmp_path / "a.yaml"), [])
    (tmp_path / "typo.yaml").write_text("base: base.yaml\nsampling: {group_sise: 2}\n")
    with pytest.raises(ConfigError, match=r"^sampling.group_sise: unknown key in .*typo.yaml \(did you mean "
                                          r"'group_size'\?\)"):
        load_recipe_config(str(tmp_path / "typo.yaml"), [])
    (tmp_path / "bad.yaml").write_text("base: [1, 2]\n")
    with pytest.raises(ConfigError, match="base must be a path to a YAML file"):
        load_recipe_config(str(tmp_path / "bad.yaml"), [])


def test_every_fragment_is_a_base_of_some_config_and_runs_nothing_alone():
    """Fragments hold settings shared by several configs; they name no recipe (nothing runs them alone) and each
    is composed into at least one config, so none is dead."""
    from flowrl.config import _base_chain

    used = {file.resolve() for path in YAMLS if path.parent.name != "accelerate" for file, _ in _base_chain(path)}
    assert len(FRAGMENTS) >= 6
    for fragment in FRAGMENTS:
        assert "recipe" not in (yaml.safe_load(fragment.read_text()) or {}), fragment
        assert fragment.resolve() in used, f"{fragment} is named by no config"


def test_list_bases_merge_left_to_right_and_a_shared_base_once(tmp_path):
    """``base: [a, b]``: b's values win over a's; a file both bases build on is merged once, at its first place,
    so b does not reset what a changed."""
    from flowrl.config import load_config_data
    from flowrl.recipes.flow_grpo import Config

    (tmp_path / "m.yaml").write_text("sampling: {group_size: 2, batch_size: 4}\n")
    (tmp_path / "a.yaml").write_text("base: m.yaml\nsampling: {group_size: 6}\n")
    (tmp_path / "b.yaml").write_text("base: m.yaml\nsampling: {num_steps: 7}\n")
    (tmp_path / "c.yaml").write_text("base: [a.yaml, b.yaml]\nsampling: {batch_size: 12}\n")
    data = load_config_data(tmp_path / "c.yaml", Config)
    assert data["sampling"] == {"group_size": 6, "batch_size": 12, "num_steps": 7}
