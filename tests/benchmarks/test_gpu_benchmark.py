"""benchmarks/gpu.py cannot run here (it needs a GPU): its --smoke mode runs the same code path on the tiny SD3
pipeline on the CPU, so the file imports, parses its arguments and produces every field of its table."""

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu  # noqa: E402


def test_gpu_benchmark_smoke_runs_the_whole_epoch_and_the_diffusers_reference(tmp_path):
    out = tmp_path / "gpu.json"
    result = gpu.main(["--smoke", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result and result["smoke"] is True
    assert [r["config"] for r in result["results"]] == ["lora/native", "full/native"]  # no xformers on a CPU
    lora, full = result["results"]
    # LoRA trains the adapters only (r 32 is wider than the tiny model's layers, so it is not smaller here)
    assert 0 < lora["trained_params"] != full["trained_params"] > 0
    for row in result["results"]:
        for key in ("rollout_s", "pipeline_s", "training_s", "epoch_s", "images_per_s", "overhead"):
            assert math.isfinite(row[key]), (row["config"], key)
        assert row["rollout_s"] > 0 and row["pipeline_s"] > 0 and row["training_s"] > 0
        assert row["grad_norm"] > 0  # the training pass really updated
        assert abs(row["epoch_s"] - (row["rollout_s"] + row["training_s"])) < 1e-2
        assert abs(row["images_per_s"] - 4 / row["epoch_s"]) < 1e-2 * row["images_per_s"] + 1e-3
    assert "| lora/native |" in gpu.table(result)
