"""A parameter snapshot under FSDP2 on two CPU processes (gloo), for tests/rl/test_snapshots_fsdp2.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/recipes/fsdp_snapshot_worker.py MODEL_DIR OUT_JSON

FSDP2 all-gathers a module's sharded parameters in its forward pre-hook and registers the gathered ones on the
module, which overwrites the tensors ``torch.func.functional_call`` swaps in: a snapshot predicted with the live
weights. The worker prepares the tiny shapes model under FSDP2 (fsdp_cpu_worker.fsdp2_dist), zeroes a snapshot,
and writes what the snapshot predicts, what the live model predicts before and after it, and the policy's gradient
with a snapshot forward between its forward and backward, next to the same on one process without FSDP.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def velocities(model_dir: str, dist):
    import torch

    from flowrl.models.shapes import ShapesModel
    from flowrl.rl.param_snapshots import ParamSnapshot

    model = ShapesModel.from_pretrained(model_dir)
    model.denoiser.requires_grad_(True)
    optimizer = torch.optim.AdamW([p for p in model.denoiser.parameters()], lr=1e-3)
    if dist is not None:
        model.denoiser, optimizer = dist.prepare_training(model.denoiser, optimizer, micro_batch_size=2, grad_clip=1.0)
    snapshot = ParamSnapshot(model)
    for tensor in snapshot.tensors.values():
        with torch.no_grad():
            tensor.mul_(0.5)  # a snapshot other than the live weights
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 32, 32, generator=generator)
    sigma = torch.tensor([0.3, 0.8])
    cond = model.encode_prompts(["a red circle", "two blue squares"])
    velocity = model.velocity_fn(1.0)
    with torch.no_grad():
        live_before = velocity(x, sigma, cond)
        with snapshot.active(model):
            snap = velocity(x, sigma, cond)
        live_after = velocity(x, sigma, cond)
    # A snapshot forward between the policy's forward and its backward leaves the gradient as it was.
    loss = velocity(x, sigma, cond).square().mean()
    with torch.no_grad(), snapshot.active(model):
        velocity(x, sigma, cond)
    loss.backward()
    grads = [p.grad for p in model.trainable_parameters()]
    norm = float(torch.sqrt(sum((g.full_tensor() if hasattr(g, "full_tensor") else g).float().square().sum()
                                for g in grads)))
    state = dist.gather_full(snapshot.state_dict()) if dist is not None else snapshot.state_dict()  # as checkpoints
    whole = all(type(v) is torch.Tensor for v in state.values())
    return {"snapshot": snap.flatten()[:64].tolist(), "live_before": live_before.flatten()[:64].tolist(),
            "live_after": live_after.flatten()[:64].tolist(), "grad_norm": norm, "state_whole": whole}


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    from fsdp_cpu_worker import fsdp2_dist

    dist = fsdp2_dist()
    result = velocities(argv[0], dist)
    if dist.is_main:
        result["reference"] = velocities(argv[0], None)
        Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    from flowrl.dist import exit_process

    raise SystemExit(exit_process(main(sys.argv[1:])))
