"""Every YAML shipped under configs/ loads: recipe configs through flowrl's typed loader (which rejects
unknown keys and bad values), accelerate configs through accelerate's own loader."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from flowrl.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[1]
YAMLS = sorted((ROOT / "configs").rglob("*.yaml"))


def test_there_are_configs_of_every_kind():
    names = {p.relative_to(ROOT / "configs").as_posix() for p in YAMLS}
    for required in ("shapes/pretrain.yaml", "shapes/flow_grpo.yaml", "sd3/flow_grpo_geneval.yaml",
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
