"""Worker of tests/rewards/test_adversarial.py's data-parallel test (not collected by pytest).

    python tests/rewards/adversarial_dist_worker.py OUT                       # one process, the whole batch
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml tests/rewards/adversarial_dist_worker.py OUT

Each process takes its slice of one fixed batch of 8 colour-shifted shapes images, runs 3 discriminator
updates with gradients averaged by ``Dist.all_reduce_mean_``, and rank 0 saves the reward's state.
"""

import sys

import numpy as np
import torch

import rewards
from flowrl.data.shapes import prompt_rows
from flowrl.dist import Dist
from rewards.adversarial_refs import ShapesReferences
from rewards.shapes_synth import colour_cast

GLOBAL_BATCH = 8
UPDATES = 3


def fixed_fakes() -> tuple[torch.Tensor, list[str]]:
    prompts = [row[0] for row in prompt_rows("train", GLOBAL_BATCH, seed=7)]
    real, _ = ShapesReferences().draw(prompts, torch.arange(GLOBAL_BATCH) + 100, True, lambda x: x)
    array = colour_cast(real.permute(0, 2, 3, 1).numpy(), np.array([1.0, 0.9, 0.7], dtype=np.float32))
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous(), prompts


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist = Dist(cpu=True)
    reward = rewards.load("adversarial", seed=3, rank=dist.rank, world_size=dist.world_size,
                          grad_sync=dist.all_reduce_mean_ if dist.world_size > 1 else None)
    fakes, prompts = fixed_fakes()
    local = GLOBAL_BATCH // dist.world_size
    rows = slice(dist.rank * local, (dist.rank + 1) * local)
    for _ in range(UPDATES):
        reward.update(fakes[rows], prompts[rows])
    if dist.is_main:
        torch.save({"state": reward.state_dict(), "world_size": dist.world_size}, out)
    dist.close()


if __name__ == "__main__":
    from flowrl.dist import exit_process

    main(sys.argv[1])
    exit_process(0)
