"""The process settings a run applies before it trains (flowrl.run.runtime.prepare_run)."""
import pytest
import torch

from flowrl.config import RunConfig
from flowrl.run.runtime import prepare_run


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


def test_tf32_is_on_by_default_and_a_switch_turns_it_off(tmp_path):
    """run.tf32 sets CUDA's TF32 flags for matmuls and convolutions (on by default); the CPU's kernels never read
    them, so a CPU run's numbers are the same either way."""
    from flowrl.config import from_dict

    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = [f.allow_tf32 for f in flags]
    a, b = torch.randn(67, 129), torch.randn(129, 33)
    conv, image = torch.nn.Conv2d(3, 8, 3), torch.randn(2, 3, 9, 9)
    try:
        prepare_run(from_dict(RunConfig, {"output_dir": str(tmp_path / "tf32_off"), "tf32": False}))
        assert not any(f.allow_tf32 for f in flags)
        exact = a @ b, conv(image)
        assert RunConfig().tf32
        prepare_run(RunConfig(output_dir=str(tmp_path / "tf32_on")))
        assert all(f.allow_tf32 for f in flags)
        assert torch.equal(a @ b, exact[0]) and torch.equal(conv(image), exact[1])
    finally:
        for f, value in zip(flags, saved):
            f.allow_tf32 = value
