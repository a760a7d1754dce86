"""``flowrl doctor``: a ten-minute check of a GPU machine, for the first person who runs flowrl on one.

    flowrl doctor [--device cuda] [--out doctor/] [--size sd35m|tiny] [--skip STAGE ...]

Stages (each reports ok / failed with its one-line error, its seconds and what it measured):

1. ``environment``: torch and its CUDA build, the GPUs and their memory, bfloat16, flowrl's version; on a machine
   without a usable GPU, why (:func:`flowrl.hardware.no_cuda_reason`).
2. ``tiny_sd3``: a tiny SD3 pipeline trained with Flow-GRPO through ``flowrl train`` on the device: a PickScore
   reward whose scores come back on the GPU, the evaluation before training with the hacking panel, two epochs with
   an EMA of the weights and checkpoints, then a resume for a third epoch and a LoRA export. These are the paths every
   GPU user meets first (until 2026-12-07 the evaluation at epoch 0 and the first step after a resume crashed).
3. ``sd35m_epoch``: one Flow-GRPO epoch (LoRA, as Flow-GRPO trains it) of a random-weight model of SD3.5-Medium's
   transformer size (24 blocks of 24 x 64 heads, ~2.2B parameters; tiny text encoders, the real VAE's shape) at
   512 px: seconds per image sampled, seconds per training image, peak GPU memory, the clip fraction and the KL to
   the old policy. ``--size tiny`` runs it on the tiny transformer (tests, a machine without the memory).
4. ``fsdp2_lora``: with two or more GPUs, the tiny SD3 run under ``accelerate launch`` with FSDP2 and LoRA
   (configs/accelerate/fsdp.yaml).

Everything lands in ``--out``: ``doctor.json`` (every stage's numbers) and the printed table (``doctor.md``), the two
files to send back (README, "Running on a GPU"). Nothing is downloaded: the models are built from configs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

__all__ = ["STAGES", "main", "run_doctor"]

STAGES = ("environment", "tiny_sd3", "sd35m_epoch", "fsdp2_lora")
ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is flowrl/commands/doctor.py)


def _environment(device: torch.device) -> dict:
    import flowrl
    from flowrl.hardware import native_bfloat16, no_cuda_reason

    info = {"flowrl": flowrl.__version__, "torch": torch.__version__, "torch_cuda_build": torch.version.cuda,
            "python": sys.version.split()[0], "device": str(device), "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpus"] = [{"name": torch.cuda.get_device_name(i),
                         "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                        for i in range(torch.cuda.device_count())]
        info["bf16"] = torch.cuda.is_bf16_supported()
    else:
        info["why_no_cuda"] = no_cuda_reason()
        info["cpu_bf16"] = native_bfloat16()
    return info


def _train(args: list[str], out: Path) -> list[dict]:
    """``flowrl train`` in this process; the run's metrics rows (raises with the run's error line on failure)."""
    from flowrl.run.metrics import read_metrics
    from flowrl.commands.train import main as train

    code = train(args)
    if code != 0:
        error = out / "error.log"
        last = error.read_text().strip().splitlines()[-1] if error.is_file() else f"exit code {code}"
        raise RuntimeError(f"flowrl train exited with {code}: {last}")
    return read_metrics(out / "metrics.jsonl")


def _tiny_sd3_args(config: Path, out: Path, device: str, prompts: Path, pickscore: tuple[str, str]) -> list[str]:
    from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny

    model, processor = pickscore
    settings = {
        "model.path": build_tiny("sd3"), "model.resolution": TINY_RESOLUTION,
        "model.max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, "model.lora": "{rank: 4, alpha: 8}",
        "model.dtype": "float32", "run.output_dir": out, "run.max_minutes": "null", "run.device": device,
        "data.train_prompts": prompts, "data.eval_prompts": prompts, "data.num_eval_prompts": 4,
        "sampling.num_steps": 6, "sampling.eval_num_steps": 4, "sampling.group_size": 4,
        "sampling.groups_per_epoch": 2, "sampling.batch_size": 4, "train.micro_batch_size": 4,
        "train.ema_decay": 0.9, "checkpoint.every_epochs": 1, "eval.at_start": "true", "eval.every_epochs": 2,
        "eval.every_minutes": "null", "eval.batch_size": 4, "eval.grid_size": 4, "eval.hacking.kl_prompts": 4,
        "eval.hacking.fm_prompts": 4, "eval.hacking.diversity_prompts": 2, "eval.hacking.diversity_seeds": 2,
        "reward.train": f"{{pickscore: {{weight: 1.0, kwargs: {{model: {model}, processor: {processor}}}}}}}",
        "reward.eval": "[pickscore]",
    }
    return [str(config)] + [f"{k}={v}" for k, v in settings.items()]


def _tiny_fixtures(work: Path) -> tuple[Path, tuple[str, str]]:
    from rewards.testing import tiny_hf_clip

    prompts = work / "prompts.txt"
    prompts.write_text("a red apple\na blue car\na cat on a mat\na bowl of soup\n")
    pickscore = tiny_hf_clip(work / "pickscore") if not (work / "pickscore" / "model").is_dir() else \
        (str(work / "pickscore" / "model"), str(work / "pickscore" / "processor"))
    return prompts, pickscore


def _tiny_sd3(device: str, work: Path) -> dict:
    from flowrl.commands.export import main as export

    prompts, pickscore = _tiny_fixtures(work)
    out = work / "tiny_sd3"
    args = _tiny_sd3_args(ROOT / "configs" / "sd3" / "flow_grpo_pickscore.yaml", out, device, prompts, pickscore)
    rows = _train(args + ["run.max_epochs=2", "run.overwrite=true"], out)
    first = rows[0]
    resumed = _train(args + ["run.max_epochs=3", "run.resume=true"], out)
    if export([str(out), "--format", "diffusers", "--out", str(work / "tiny_sd3_lora"), "--device", device]) != 0:
        raise RuntimeError("flowrl export failed (its error is printed above)")
    last = resumed[-1]
    return {"eval_at_start_pickscore": first.get("eval/pickscore/mean"), "epochs": last["epoch"],
            "reward_mean": last.get("train/reward_mean"), "loss": last.get("train/loss"),
            "panel_keys": sorted(k for k in first if k.startswith("hack/"))[:6]}


def build_sd35m_sized(path: Path, size: str, device: torch.device) -> Path:
    """A pipeline folder with SD3.5-Medium's transformer shape (``size="sd35m"``; random weights in bfloat16) or the
    tiny one (``"tiny"``), tiny text encoders, and the real VAE's shape (tiny for ``"tiny"``)."""
    import diffusers

    from flowrl.models.footprint import SD35_MEDIUM_TRANSFORMER, SD3_VAE
    from flowrl.testing.tiny_pipelines import tiny_pipeline_components

    components = tiny_pipeline_components("sd3", path / "_work")
    if size == "sd35m":
        # The text side stays tiny (its embeddings are computed once per prompt and cached); the caption and pooled
        # projections take the tiny encoders' widths, a few million of SD3.5-M's ~2.2B transformer parameters.
        config = {**SD35_MEDIUM_TRANSFORMER, "joint_attention_dim": 32, "pooled_projection_dim": 16}
        with torch.device(device):
            components["transformer"] = diffusers.SD3Transformer2DModel(**config).to(torch.bfloat16).eval()
            components["vae"] = diffusers.AutoencoderKL(**SD3_VAE).to(torch.bfloat16).eval()
    pipe = diffusers.StableDiffusion3Pipeline(**components)
    pipe.save_pretrained(str(path), safe_serialization=True)
    return path


def _sd35m_epoch(device: str, work: Path, size: str) -> dict:
    prompts, pickscore = _tiny_fixtures(work)
    model_dir = build_sd35m_sized(work / f"{size}_pipeline", size, torch.device(device))
    out = work / f"{size}_epoch"
    resolution = 512 if size == "sd35m" else 64
    dtype = "bfloat16" if size == "sd35m" else "float32"
    args = _tiny_sd3_args(ROOT / "configs" / "sd3" / "flow_grpo_pickscore.yaml", out, device, prompts, pickscore)
    args += [f"model.path={model_dir}", f"model.resolution={resolution}", f"model.dtype={dtype}",
             "model.lora={rank: 32, alpha: 64}", "run.max_epochs=1", "run.overwrite=true", "eval.at_start=false",
             "eval.every_epochs=null", "data.num_eval_prompts=2", "eval.grid_size=0", "sampling.num_steps=10",
             "sampling.group_size=4", "sampling.groups_per_epoch=2", "sampling.batch_size=4",
             "train.micro_batch_size=2", "train.ema_decay=null"]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    row = [r for r in _train(args, out) if "train/loss" in r][-1]
    images = 8
    result = {"transformer_params_m": round(_count_params(model_dir) / 1e6, 1), "resolution": resolution,
              "seconds_per_image_sampled": row["time/sampling_s"] / images,
              "seconds_per_image_trained": row["time/training_s"] / images,
              "clip_frac": row.get("train/clip_frac"), "approx_kl": row.get("train/approx_kl"),
              "loss": row.get("train/loss")}
    if torch.cuda.is_available():
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def _count_params(model_dir: Path) -> int:
    """Parameters of the saved transformer (read from the safetensors headers, nothing loaded)."""
    import math

    from safetensors import safe_open

    total = 0
    for file in (model_dir / "transformer").glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            total += sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())
    return total


def _fsdp2_lora(device: str, work: Path) -> dict:
    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU(s); FSDP2 needs two or more"}
    prompts, pickscore = _tiny_fixtures(work)
    out = work / "fsdp2"
    args = _tiny_sd3_args(ROOT / "configs" / "sd3" / "flow_grpo_pickscore.yaml", out, "auto", prompts, pickscore)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / "fsdp.yaml"), "--num_processes", "2", "-m", "flowrl", "train",
               *args, "run.max_epochs=2", "run.overwrite=true"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if "error" in line.lower()] or result.stderr.splitlines()
        raise RuntimeError(f"accelerate launch (FSDP2, 2 GPUs) exited with {result.returncode}: "
                           f"{(lines or ['no output'])[-1][:300]}")
    return {"ok_line": next((line for line in result.stdout.splitlines() if "on fsdp2" in line), "")}


def run_doctor(device: str, out: Path, size: str, skip: tuple[str, ...] = (),
               log: Callable[[str], None] = print) -> dict:
    """Run every stage not in ``skip``; each stage's failure is recorded and the others still run.

    Returns:
        ``{"stages": {name: {"ok": bool, "seconds": float, ...}}, "date": ...}`` (also written to
        ``out/doctor.json``, with the table in ``out/doctor.md``).
    """
    from flowrl.hardware import usable_device

    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)
    resolved = usable_device(device, "--device")
    stages: dict[str, Callable[[], dict]] = {
        "environment": lambda: _environment(resolved),
        "tiny_sd3": lambda: _tiny_sd3(device, work),
        "sd35m_epoch": lambda: _sd35m_epoch(device, work, size),
        "fsdp2_lora": lambda: _fsdp2_lora(device, work),
    }
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": device, "size": size, "stages": {}}
    for name, stage in stages.items():
        if name in skip:
            continue
        log(f"flowrl doctor: {name} ...")
        start = time.perf_counter()
        try:
            entry = {"ok": True, **stage()}
        except Exception as err:  # a stage's failure is a result: record it, run the others
            (work / f"{name}.traceback.txt").write_text(traceback.format_exc())
            entry = {"ok": False, "error": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"}
        entry["seconds"] = round(time.perf_counter() - start, 1)
        report["stages"][name] = entry
        log(f"flowrl doctor: {name} {'ok' if entry['ok'] else 'FAILED: ' + entry['error']} ({entry['seconds']} s)")
    (out / "doctor.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "doctor.md").write_text(table(report))
    return report


def table(report: dict) -> str:
    """The report as a Markdown table: one row per stage, its result and its measurements."""
    lines = [f"flowrl doctor, {report['date']}, device {report['device']}", "",
             "| stage | result | seconds | measured |", "|---|---|---|---|"]
    for name, entry in report["stages"].items():
        measured = {k: v for k, v in entry.items() if k not in ("ok", "seconds", "error")}
        text = "; ".join(f"{k} {_short(v)}" for k, v in measured.items())
        result = "ok" if entry["ok"] else f"FAILED: {entry['error']}"
        lines.append(f"| {name} | {result} | {entry['seconds']} | {text} |")
    return "\n".join(lines) + "\n"


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowrl doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the device to check (default: cuda when available)")
    parser.add_argument("--out", default="doctor", help="folder for doctor.json, doctor.md and the runs")
    parser.add_argument("--size", choices=("sd35m", "tiny"), default="sd35m" if torch.cuda.is_available() else "tiny",
                        help="the model of the real-size epoch (tiny on a machine without a GPU)")
    parser.add_argument("--skip", nargs="*", default=[], choices=STAGES, help="stages to leave out")
    args = parser.parse_args(argv)
    from flowrl.hardware import DeviceError

    try:
        report = run_doctor(args.device, Path(args.out), args.size, tuple(args.skip))
    except DeviceError as err:
        print(f"flowrl doctor: error: {err}", file=sys.stderr)
        return 2
    print()
    print(table(report))
    print(f"flowrl doctor: wrote {Path(args.out) / 'doctor.json'} and doctor.md; send both back (README, "
          "'Running on a GPU')")
    return 0 if all(entry["ok"] for entry in report["stages"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
