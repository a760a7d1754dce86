"""Where the shapes model's CPU time goes, at one thread: the UNet's FLOPs per image-step and its achieved FLOP/s
against this core's practical peak (a large matmul), in float32 and under bfloat16 autocast, with channels-last;
one training epoch of Flow-GRPO and DGPO (sampling / training seconds) in both precisions; and the held-out
evaluation (600 prompts) at 40 float32 steps against 20 bfloat16 steps, with the base model's accuracy each way.

Times are CPU seconds of this process (``time.process_time``) at ``torch.set_num_threads(1)``, the median of
``--repeats`` runs, so a run beside other work reads like one on an idle core.

    python benchmarks/shapes_speed.py [--repeats 3] [--quick]

Writes ``benchmarks/results/shapes_speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"


def cpu_seconds(fn, repeats: int) -> float:
    """Median CPU seconds of ``fn()`` over ``repeats`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def matmul_peak(dtype: torch.dtype, repeats: int, n: int = 1536) -> float:
    """Achieved GFLOP/s of an ``n x n`` matmul: the practical peak of one core in ``dtype``."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    seconds = cpu_seconds(lambda: torch.mm(a, b), repeats)
    return 2 * n**3 / seconds / 1e9


def unet_numbers(model, repeats: int, batch: int = 64) -> dict:
    """FLOPs per image-step of the shapes UNet (``torch.utils.flop_counter``) and its achieved GFLOP/s."""
    from torch.utils.flop_counter import FlopCounterMode

    prompts = ["a red circle left of a blue square"] * batch
    cond = model.encode_prompts(prompts)
    x = torch.randn(batch, *model.latent_shape)
    sigma = torch.full((batch,), 0.5)
    velocity = model.velocity_fn(None)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        velocity(x, sigma, cond)
    flops = counter.get_total_flops() / batch
    out = {"gflop_per_image_step": flops / 1e9}
    for name, autocast, channels_last in (("float32", False, False), ("bfloat16", True, False),
                                          ("float32_channels_last", False, True)):
        if channels_last:
            model.denoiser.to(memory_format=torch.channels_last)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            seconds = cpu_seconds(lambda: velocity(x, sigma, cond), repeats)
        if channels_last:
            model.denoiser.to(memory_format=torch.contiguous_format)
        out[name] = {"seconds_per_call": seconds, "gflops_per_s": flops * batch / seconds / 1e9}
    return out


def epoch_numbers(trainer: str, precision: str, epochs: int) -> dict:
    """Median sampling / training seconds per epoch of a short run of the shipped config (one thread)."""
    from flowrl.run.metrics import read_metrics
    from flowrl.commands.train import load_recipe_config

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"run.output_dir={tmp}/run", "run.max_minutes=null", f"run.max_epochs={epochs}", "run.threads=1",
                     "run.clock=cpu", "eval.at_start=false", "eval.every_minutes=null", "eval.every_epochs=100000",
                     "data.num_eval_prompts=1", "eval.grid_size=0", "eval.hacking.enabled=false",
                     f"sampling.precision={precision}", "checkpoint.every_epochs=100000"]
        recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / f"{trainer}.yaml"), overrides)
        recipe.main(cfg)
        rows = [r for r in read_metrics(Path(tmp) / "run" / "metrics.jsonl") if "time/sampling_s" in r][1:]  # warm
    return {key: statistics.median(r[f"time/{key}"] for r in rows)
            for key in ("sampling_s", "training_s", "epoch_s")} | {"epochs_timed": len(rows)}


def sample_and_judge(model, prompts: list[str], seeds: list[int], metadata: list[dict], judge, *, steps: int,
                     guidance: float = 1.0, batch_size: int = 32, bfloat16: bool = False) -> tuple[torch.Tensor, float]:
    """One image per prompt (the evaluation's ODE sampler, seeded per prompt, under bfloat16 autocast if asked)
    judged strictly (the judge always in float32).

    Returns:
        ``correct``: float ``[len(prompts)]``, 1 where the image meets every constraint of its prompt; and the CPU
        seconds of this process that the sampling took (the judge excluded).
    """
    from flowrl.eval.generate import generate

    start = time.process_time()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16):
        images = generate(model, prompts, seeds, steps=steps, guidance=guidance, batch_size=batch_size)
    seconds = time.process_time() - start
    return judge.score(images, prompts, metadata).details["correct"].float(), seconds


def evaluation_numbers(steps_precision: list[tuple[int, str]], prompts: int) -> dict:
    """CPU seconds and accuracy of the base model's held-out evaluation per (steps, precision)."""
    import rewards
    from flowrl.data.prompts import load_prompts
    from flowrl.models.config import ModelConfig, build_model

    prompt_set = load_prompts("shapes:eval", prompts)
    seeds = [int(m.get("seed", i)) for i, m in enumerate(prompt_set.metadata)]
    model = build_model(ModelConfig(name="shapes"), torch.device("cpu"))
    model.eval()
    reward = rewards.load("shapes")
    out = {}
    for steps, precision in steps_precision:
        correct, seconds = sample_and_judge(model, list(prompt_set.prompts), seeds, list(prompt_set.metadata), reward,
                                            steps=steps, batch_size=100, bfloat16=precision == "bfloat16")
        out[f"{steps}_{precision}"] = {"cpu_s": seconds, "accuracy": float(correct.mean())}
    return out


def markdown(result: dict) -> str:
    u, peak = result["unet"], result["peak_gflops_per_s"]
    lines = ["# The shapes model's CPU time (one thread)", "",
             f"Measured {result['date']} on {result['machine']}; medians of {result['repeats']} runs, CPU seconds.", "",
             f"UNet: {u['gflop_per_image_step']:.2f} GFLOP per image per step. Practical peak of one core (matmul): "
             f"{peak['float32']:.0f} GFLOP/s float32, {peak['bfloat16']:.0f} GFLOP/s bfloat16.", "",
             "| UNet forward (batch 64) | s per call | GFLOP/s | share of peak |", "|---|---|---|---|"]
    for name, ref in (("float32", "float32"), ("bfloat16", "bfloat16"), ("float32_channels_last", "float32")):
        row = u[name]
        lines.append(f"| {name} | {row['seconds_per_call']:.3f} | {row['gflops_per_s']:.0f} | "
                     f"{row['gflops_per_s'] / peak[ref]:.0%} |")
    lines += ["", "| epoch (128 images x 10 steps) | sampling s | training s | epoch s |", "|---|---|---|---|"]
    for key, row in result["epochs"].items():
        lines.append(f"| {key} | {row['sampling_s']:.1f} | {row['training_s']:.1f} | {row['epoch_s']:.1f} |")
    lines += ["", f"| evaluation ({result['eval_prompts']} prompts, base model) | CPU s | accuracy |", "|---|---|---|"]
    for key, row in result["evaluation"].items():
        lines.append(f"| {key.replace('_', ' steps, ')} | {row['cpu_s']:.0f} | {row['accuracy']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    import platform

    p = argparse.ArgumentParser(prog="benchmarks/shapes_speed.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="fewer epochs and prompts (a smoke run)")
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv if argv is not None else [])
    torch.set_num_threads(1)
    from flowrl.models.config import ModelConfig, build_model

    model = build_model(ModelConfig(name="shapes"), torch.device("cpu"))
    model.eval()
    epochs = 2 if args.quick else 4
    prompts = 20 if args.quick else 600
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} thread, torch {torch.__version__}", "repeats": args.repeats,
              "peak_gflops_per_s": {"float32": matmul_peak(torch.float32, args.repeats),
                                    "bfloat16": matmul_peak(torch.bfloat16, args.repeats)},
              "unet": unet_numbers(model, args.repeats), "eval_prompts": prompts,
              "epochs": {f"{trainer} {precision}": epoch_numbers(trainer, precision, epochs)
                         for trainer in ("flow_grpo", "dgpo") for precision in ("float32", "bfloat16")},
              "evaluation": evaluation_numbers([(40, "float32"), (20, "float32"), (20, "bfloat16")], prompts)}
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    if not args.quick:
        (out / "shapes_speed.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "shapes_speed.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
