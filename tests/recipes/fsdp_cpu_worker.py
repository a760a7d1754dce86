"""Run a recipe on flowrl's FSDP2 path with CPU processes (gloo), for tests/recipes/test_flow_grpo_distributed.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/recipes/fsdp_cpu_worker.py CONFIG [a.b=c ...]

accelerate 1.15 turns an FSDP launch config into plain DDP when it runs on CPU (``AcceleratorState`` enables
FSDP only for GPU-like devices), although torch's FSDP2 (``fully_shard``) itself runs on CPU with gloo. This
worker builds flowrl's :class:`~flowrl.dist.Dist` and then marks accelerate's state as FSDP with an FSDP2
plugin, so that ``prepare_training``, the DTensor parameters, ``save_state`` / ``load_state`` of sharded model
and optimizer, and flowrl's gathering of sharded state all run exactly as they would on GPUs. Nothing of flowrl
is patched; only accelerate's device check is bypassed.
"""

from __future__ import annotations

import sys


def fsdp2_dist():
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from flowrl.dist import Dist

    dist = Dist(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True,
                                            cpu_ram_efficient_loading=False)
    # AcceleratorState() copies PartialState's fields each time it is constructed: set both.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    dist.accelerator.state.distributed_type = DistributedType.FSDP
    dist.accelerator.state.fsdp_plugin = plugin
    assert dist.backend == "fsdp2", dist.backend
    return dist


def main(argv: list[str]) -> int:
    from flowrl.commands.train import load_recipe_config

    recipe, cfg = load_recipe_config(argv[0], argv[1:])
    dist = fsdp2_dist()
    if dist.is_main:
        print(f"fsdp_cpu_worker: backend {dist.backend}", flush=True)
    return int(recipe.main(cfg, dist=dist) or 0)


if __name__ == "__main__":
    from flowrl.dist import exit_process

    raise SystemExit(exit_process(main(sys.argv[1:])))
