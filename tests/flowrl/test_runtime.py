"""The process settings a run applies before it trains (flowrl.runtime.prepare_run)."""
import pytest
import torch

from flowrl.config import RunConfig
from flowrl.runtime import prepare_run


def test_a_run_flushes_float32_denormals_unless_told_not_to(tmp_path):
    # 1e-20 squared is 1e-40, below float32's smallest normal (1.2e-38): a denormal, which x86 CPUs compute ~100x
    # slower (a saturated Diffusion-DPO loss made epochs 3x slower); flushed, it is 0.
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals (torch.set_flush_denormal returns False)")
    torch.set_flush_denormal(False)
    tiny = torch.full((64,), 1e-20)
    assert (tiny * tiny)[0].item() == pytest.approx(1e-40, rel=1e-3)
    prepare_run(RunConfig(output_dir=str(tmp_path / "flushed")))
    assert torch.equal(tiny * tiny, torch.zeros(64))
    prepare_run(RunConfig(output_dir=str(tmp_path / "kept"), flush_denormal=False))
    assert (tiny * tiny)[0].item() == pytest.approx(1e-40, rel=1e-3)
