"""What a few-step student saves: CPU seconds per image of the shapes model's sampler (the ODE and the decode, float32,
one thread) for the 20-step teacher (the held-out evaluation's sampler), the teacher under classifier-free guidance
(two model calls per step), the teacher at 10 steps (the RL rollouts of configs/shapes/dgpo.yaml) and at 4, and each
student folder given, at its own step count; and each one's strict accuracy on the same held-out prompts and seeds.

Times are CPU seconds of this process (``time.process_time``) at ``torch.set_num_threads(1)``, the median of
``--repeats`` runs over the first ``--timed`` prompts, so a run beside other work reads like one on an idle core. The
accuracy is over the first ``--prompts`` prompts of ``shapes:eval`` (each kind equally), one image per prompt.

    python benchmarks/student_speed.py --student NAME=DIR[:STEPS] [...] [--prompts 600] [--repeats 3]

Writes ``benchmarks/results/student_speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"


def sampler_row(model, prompts, seeds, metadata, judge, *, steps: int, guidance: float, timed: int,
                repeats: int) -> dict:
    """CPU seconds per image (median of ``repeats`` over ``timed`` prompts) and strict accuracy over all prompts."""
    from benchmarks.shapes_speed import sample_and_judge
    from flowrl.eval.generate import generate

    def run(n: int) -> torch.Tensor:
        with torch.no_grad():
            return generate(model, prompts[:n], seeds[:n], steps=steps, guidance=guidance, batch_size=32)

    run(min(8, timed))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run(timed)
        times.append((time.process_time() - start) / timed)
    correct, _ = sample_and_judge(model, prompts, seeds, metadata, judge, steps=steps, guidance=guidance)
    kinds = [m.get("kind", "?") for m in metadata]
    per_kind = {k: float(correct[[i for i, x in enumerate(kinds) if x == k]].mean()) for k in sorted(set(kinds))}
    return {"steps": steps, "guidance": guidance, "model_calls_per_image": steps * (2 if guidance != 1.0 else 1),
            "cpu_s_per_image": statistics.median(times), "strict": float(correct.mean()), "per_kind": per_kind}


def markdown(result: dict) -> str:
    rows = result["rows"]
    base = rows["teacher, 20 steps"]["cpu_s_per_image"]
    lines = ["# Few-step students: sampler cost and strict accuracy (shapes model, one thread)", "",
             f"Measured {result['date']} on {result['machine']}; CPU seconds per image (ODE + decode, float32, batch "
             f"32), median of {result['repeats']} runs over {result['timed']} prompts; strict accuracy over the first "
             f"{result['prompts']} held-out prompts.", "",
             "| sampler | model calls / image | CPU s / image | cheaper than the 20-step teacher | strict | per kind |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        kinds = " / ".join(f"{v:.2f}" for v in r["per_kind"].values())
        lines.append(f"| {name} | {r['model_calls_per_image']} | {r['cpu_s_per_image']:.4f} | "
                     f"{base / r['cpu_s_per_image']:.2f}x | {r['strict']:.3f} | {kinds} |")
    lines += ["", "Kinds: " + " / ".join(next(iter(rows.values()))["per_kind"]) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="benchmarks/student_speed.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", action="append", default=[], metavar="NAME=DIR[:STEPS]",
                   help="a student folder (flowrl export --format merged) and its step count (default 4)")
    p.add_argument("--prompts", type=int, default=600)
    p.add_argument("--timed", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--teacher-guidance", type=float, default=2.0)
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    import rewards
    from flowrl.data.prompts import load_prompts
    from flowrl.models.config import ModelConfig, build_model

    prompt_set = load_prompts("shapes:eval", args.prompts)
    prompts, metadata = list(prompt_set.prompts), list(prompt_set.metadata)
    seeds = [int(m.get("seed", i)) for i, m in enumerate(metadata)]
    judge = rewards.load("shapes")
    common = dict(timed=args.timed, repeats=args.repeats)
    teacher = build_model(ModelConfig(name="shapes"), torch.device("cpu")).eval()
    rows = {}
    for steps, guidance in ((20, 1.0), (20, args.teacher_guidance), (10, 1.0), (4, 1.0)):
        name = f"teacher, {steps} steps" + (f", guidance {guidance:g}" if guidance != 1.0 else "")
        rows[name] = sampler_row(teacher, prompts, seeds, metadata, judge, steps=steps, guidance=guidance, **common)
        print(name, rows[name], flush=True)
    for spec in args.student:
        name, _, rest = spec.partition("=")
        path, _, steps = rest.partition(":")
        student = build_model(ModelConfig(name="shapes", path=path), torch.device("cpu")).eval()
        rows[f"{name}, {int(steps or 4)} steps"] = sampler_row(student, prompts, seeds, metadata, judge,
                                                               steps=int(steps or 4), guidance=1.0, **common)
        print(name, rows[f"{name}, {int(steps or 4)} steps"], flush=True)
    result = {"date": date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, 1 thread",
              "prompts": args.prompts, "timed": args.timed, "repeats": args.repeats, "rows": rows}
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "student_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "student_speed.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
