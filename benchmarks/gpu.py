"""GPU benchmark: one Flow-GRPO epoch on a Stable Diffusion 3.5 Medium-shaped transformer (random weights, nothing
downloaded), against plain diffusers at the same settings.

    python benchmarks/gpu.py [--out benchmarks/results/gpu.json] [--repeats 2] [--configs lora/native full/native]
    python benchmarks/gpu.py --smoke    # the tiny SD3 pipeline on the CPU: checks the code path; its times mean nothing

Settings (the shipped ``configs/sd3/flow_grpo_pickscore.yaml`` with a smaller epoch): the SD3.5-Medium transformer
(24 MMDiT-X blocks, 2.24B parameters) and the 16-channel SD3 VAE, randomly initialised in bfloat16 (the VAE in
float32, as flowrl loads it); 512 px; 4 prompts x group 8 = 32 images per epoch; Flow-SDE rollouts of 10 steps with
log-probabilities, classifier-free guidance 4.5, rollout calls of 8 images (16 transformer rows); the training pass
over the 9 stochastic steps with micro-batches of 8, gradient checkpointing, KL to the reference (beta 0.01),
Flow-GRPO's detached unconditional branch, one AdamW step per half epoch. The text conditioning is random tensors
of the real shapes (77 CLIP + 128 T5 tokens x 4096, pooled 2048): the text encoders are not what is measured.

For each configuration -- LoRA r32 / full fine-tuning, PyTorch SDPA / xformers (when installed) -- it reports the
median over ``--repeats`` epochs (after one warm-up epoch) of:

- ``rollout_s``: flowrl's ``collect_epoch`` (rollout with log-probs, VAE decode, the reward in its thread);
- ``pipeline_s``: ``StableDiffusion3Pipeline(...)`` on the same transformer, VAE, embeddings, noise and batches
  (no log-probs), and ``overhead = rollout_s / pipeline_s - 1`` (goal: under 5%);
- ``training_s``: advantages and ``flow_grpo.train_epoch`` (forward-backward passes and optimizer steps);
- ``epoch_s`` = rollout + training, ``images_per_s`` = 32 / epoch_s, and the peak GPU memory of each phase.

Results go to ``--out`` as JSON and to stdout as a Markdown table. Run it alone on the GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from anywhere without installing the package
    sys.path.insert(0, str(ROOT))

RESULT = ROOT / "benchmarks" / "results" / "gpu.json"
CONFIG = ROOT / "configs" / "sd3" / "flow_grpo_pickscore.yaml"
PROMPTS = ["a photo of a red bicycle leaning on a wall", "an oil painting of a lighthouse at dusk",
           "a bowl of ramen with chopsticks", "a corgi wearing sunglasses on a beach"]
CONFIGS = ("lora/native", "full/native", "lora/xformers", "full/xformers")


def settings(smoke: bool) -> dict:
    if smoke:
        return {"resolution": 64, "steps": 3, "groups": 2, "group_size": 2, "batch": 2, "micro_batch": 2,
                "t5_tokens": 16, "dtype": torch.float32, "device": "cpu"}
    return {"resolution": 512, "steps": 10, "groups": 4, "group_size": 8, "batch": 8, "micro_batch": 8,
            "t5_tokens": 128, "dtype": torch.bfloat16, "device": "cuda"}


def build_model(s: dict, lora: bool, smoke: bool, workdir: Path):
    """An ``SD3Model`` around a ``StableDiffusion3Pipeline`` whose transformer and VAE are SD3.5-Medium-shaped
    with random weights (the tiny pipeline's own in ``--smoke``); tokenizers and text encoders are the tiny ones
    (unused: the conditioning is injected)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline

    from flowrl.config import LoraConfig
    from flowrl.models.footprint import SD3_VAE, SD35_MEDIUM_TRANSFORMER
    from flowrl.models.sd3 import SD3Model
    from flowrl.testing import tiny_pipeline_components

    parts = tiny_pipeline_components("sd3", workdir)
    torch.manual_seed(0)
    if not smoke:
        with torch.device(s["device"]):
            parts["transformer"] = SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER).to(s["dtype"]).eval()
            parts["vae"] = AutoencoderKL(**SD3_VAE, scaling_factor=1.5305, shift_factor=0.0609).eval()
    pipe = StableDiffusion3Pipeline(**parts).to(s["device"])
    settings_ = LoraConfig(rank=32, alpha=64) if lora else None
    model = SD3Model(pipe, lora=settings_, gradient_checkpointing=True, resolution=s["resolution"],
                     max_sequence_length=s["t5_tokens"], guidance_scale=4.5)
    model.to(s["device"])
    model.freeze_reference()
    return model


def inject_conditioning(model, prompts: list[str], s: dict) -> dict:
    """Random conditioning of the real shapes in the model's prompt cache (and the same tensors for the
    pipeline): ``{prompt: (prompt_embeds [1, L, D], pooled [1, P])}``."""
    config = model.denoiser.config
    length = model.pipeline.tokenizer.model_max_length + s["t5_tokens"]
    generator = torch.Generator().manual_seed(1)
    table = {}
    for prompt in [""] + list(prompts):
        embeds = torch.randn(1, length, config.joint_attention_dim, generator=generator).to(s["dtype"])
        pooled = torch.randn(1, config.pooled_projection_dim, generator=generator).to(s["dtype"])
        model._prompt_cache[prompt] = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        table[prompt] = (embeds, pooled)
    return table


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None  # no GPU: not measured


def pipeline_epoch(model, batch, table: dict, s: dict) -> float:
    """Seconds of plain ``StableDiffusion3Pipeline`` calls producing the same images as the rollout's
    (same noise, batches, guidance and steps; no log-probs)."""
    from samplers import initial_noise

    pipe = model.pipeline
    neg_e, neg_p = table[""]
    _sync(s["device"])
    start = time.perf_counter()
    for i in range(0, len(batch.prompts), s["batch"]):
        prompts = batch.prompts[i:i + s["batch"]]
        embeds = torch.cat([table[p][0] for p in prompts]).to(s["device"])
        pooled = torch.cat([table[p][1] for p in prompts]).to(s["device"])
        noise = initial_noise(model.latent_shape, batch.sample_seeds[i:i + s["batch"]], device=s["device"])
        with torch.no_grad():
            pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled,
                 negative_prompt_embeds=neg_e.expand(len(prompts), -1, -1).to(s["device"]),
                 negative_pooled_prompt_embeds=neg_p.expand(len(prompts), -1).to(s["device"]),
                 num_inference_steps=s["steps"], guidance_scale=4.5, height=s["resolution"], width=s["resolution"],
                 latents=noise.to(s["dtype"]), output_type="pt")
    _sync(s["device"])
    return time.perf_counter() - start


def run_config(name: str, s: dict, repeats: int, smoke: bool, dist, workdir: Path) -> dict:
    from flowrl.core.advantages import PerPromptStatTracker
    from flowrl.data.prompt_groups import PromptGroups
    from flowrl.recipes.flow_grpo import train_epoch
    from flowrl.rl.epoch_advantages import compute_advantages
    from flowrl.rl.collect import collect_epoch
    from flowrl.rl.optim import build_optimizer
    from flowrl.rl.passes import UpdateHealth
    from flowrl.rl.sampling import rollout_step, rollout_window
    from flowrl.commands.train import load_recipe_config
    from rewards import RewardOutput

    kind, backend = name.split("/")
    overrides = [f"sampling.num_steps={s['steps']}", "sampling.window={mode: fixed, start: 0, size: null}",
                 f"sampling.group_size={s['group_size']}", f"sampling.groups_per_epoch={s['groups']}",
                 f"sampling.batch_size={s['batch']}", f"train.micro_batch_size={s['micro_batch']}",
                 "train.ema_decay=null", f"model.lora={'{rank: 32, alpha: 64}' if kind == 'lora' else 'null'}"]
    if kind == "full":
        overrides.append("optim.lr=1e-5")
    _, cfg = load_recipe_config(str(CONFIG), overrides)
    model = build_model(s, lora=kind == "lora", smoke=smoke, workdir=workdir)
    if backend != "native":
        model.set_attention_backend(backend)
    table = inject_conditioning(model, PROMPTS, s)
    groups = PromptGroups(PROMPTS, [{} for _ in PROMPTS], groups=s["groups"], group_size=s["group_size"], seed=0)
    optimizer, _ = build_optimizer(model.trainable_parameters(), cfg.optim)
    sc = cfg.sampling
    step, window = rollout_step(sc, model.sigmas(sc.num_steps)), rollout_window(sc)
    tracker = PerPromptStatTracker(cfg.advantage.per_prompt_buffer, cfg.advantage.per_prompt_min_count)

    def reward(images, prompts, metadata=None):  # cheap and non-constant: the reward is not what is measured
        return RewardOutput(images.float().mean(dim=(1, 2, 3)))

    rows = []
    for epoch in range(repeats + 1):  # epoch 0 warms up (kernels, allocator)
        batch = groups.epoch(epoch)
        pipeline_s = pipeline_epoch(model, batch, table, s)
        _peak_reset(s["device"])
        _sync(s["device"])
        t0 = time.perf_counter()
        rollouts = collect_epoch(model, batch, step=step, window=window, epoch=epoch, seed=0, reward=reward,
                                 guidance=sc.guidance, batch_size=sc.batch_size)
        _sync(s["device"])
        t1 = time.perf_counter()
        peak_rollout = _peak_gib(s["device"])
        _peak_reset(s["device"])
        advantages, valid, _ = compute_advantages(rollouts, cfg.advantage, dist, seed=0, epoch=epoch, tracker=tracker,
                                                  model=model, reward=reward, guidance=sc.guidance,
                                                  batch_size=sc.batch_size)
        metrics = train_epoch(model, optimizer, rollouts, advantages, valid, cfg, dist, epoch, health=UpdateHealth())
        _sync(s["device"])
        t2 = time.perf_counter()
        rows.append({"rollout_s": t1 - t0, "pipeline_s": pipeline_s, "training_s": t2 - t1,
                     "peak_rollout_gib": peak_rollout, "peak_training_gib": _peak_gib(s["device"]),
                     "grad_norm": metrics["train/grad_norm"]})
    timed = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in timed) if timed[0][k] is not None else None for k in timed[0]}
    images = s["groups"] * s["group_size"]
    epoch_s = med["rollout_s"] + med["training_s"]
    trained = sum(p.numel() for p in model.trainable_parameters())
    del model, optimizer
    if s["device"] == "cuda":
        torch.cuda.empty_cache()
    return {"config": name, "trained_params": trained, "trained_params_m": round(trained / 1e6, 2),
            **{k: None if v is None else round(v, 4) for k, v in med.items()},
            "overhead": round(med["rollout_s"] / med["pipeline_s"] - 1, 4), "epoch_s": round(epoch_s, 3),
            "images_per_s": round(images / epoch_s, 3)}


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(result: dict) -> str:
    head = ("| config | trained params | rollout s | diffusers s | rollout overhead | training s | s / epoch | "
            "images / s | peak GiB rollout / training |")
    lines = [head, "|" + "---|" * 9]
    for r in result["results"]:
        lines.append(f"| {r['config']} | {r['trained_params_m']:,.1f}M | {r['rollout_s']:.2f} | "
                     f"{r['pipeline_s']:.2f} | "
                     f"{100 * r['overhead']:+.1f}% | {r['training_s']:.2f} | {r['epoch_s']:.2f} | "
                     f"{r['images_per_s']:.2f} | {_gib(r['peak_rollout_gib'])} / {_gib(r['peak_training_gib'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    import importlib.util

    import diffusers

    from flowrl.dist import Dist

    parser = argparse.ArgumentParser(prog="python benchmarks/gpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny SD3 pipeline on the CPU (checks the code path)")
    parser.add_argument("--repeats", type=int, default=2, help="timed epochs per configuration (default 2)")
    parser.add_argument("--configs", nargs="+", default=None, choices=CONFIGS,
                        help="default: lora/native full/native, and the xformers ones when xformers is installed")
    parser.add_argument("--out", default=None,
                        help=f"JSON results (default {RESULT.relative_to(ROOT)}; none with --smoke)")
    args = parser.parse_args(argv)
    s = settings(args.smoke)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or --smoke for the CPU code-path check")
    has_xformers = importlib.util.find_spec("xformers") is not None and s["device"] == "cuda"
    names = args.configs or [c for c in CONFIGS if c.endswith("native") or has_xformers]
    if args.smoke:
        torch.set_num_threads(1)
    dist = Dist(cpu=args.smoke)
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            results.append(run_config(name, s, args.repeats, args.smoke, dist, Path(workdir)))
            print(f"{name}: {results[-1]}", flush=True)
    result = {
        "benchmark": "gpu", "date": datetime.date.today().isoformat(), "smoke": args.smoke,
        "device": torch.cuda.get_device_name(0) if s["device"] == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "diffusers": diffusers.__version__,
        "xformers": (__import__("xformers").__version__ if has_xformers else None),
        "settings": {k: str(v) for k, v in s.items()}, "seconds": round(time.perf_counter() - started, 1),
        "results": results,
    }
    print(table(result))
    out = Path(args.out) if args.out else (None if args.smoke else RESULT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
