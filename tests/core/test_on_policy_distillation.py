"""On-policy distillation's loss (flowrl/rl/teacher.py) against the authors' code: verl-omni's
``DistillKLLoss.compute_loss`` (github.com/verl-project/verl-omni @ a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
``verl_omni/trainer/diffusion/diffusion_algos.py``), run as written in float64 on seeded inputs by a script outside
the repository (it takes the function's source from that file with ``ast``, executes it and writes
``opd_reference/distill_kl_reference.json``: the inputs, the loss and its gradient in the student's mean).

flowrl's loss is :func:`flowrl.core.losses.gaussian_kl` with ``reduction="mean"`` (the per-sample KL averaged over
the non-batch elements), averaged over the batch; the authors divide the per-sample mean squared difference by
``2 std^2`` with one std per sample, the same number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl.core.losses import gaussian_kl

REFERENCE = json.loads((Path(__file__).parent / "opd_reference" / "distill_kl_reference.json").read_text())


@pytest.mark.parametrize("case", range(len(REFERENCE["cases"])))
def test_the_distillation_kl_is_verl_omnis(case):
    c = REFERENCE["cases"][case]
    mean = torch.tensor(c["prev_sample_mean"], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor(c["teacher_prev_sample_mean"], dtype=torch.float64)
    std = torch.tensor(c["std_dev_t"], dtype=torch.float64)  # [bs]: one std per sample
    loss = gaussian_kl(mean, teacher, std, reduction="mean").mean()
    loss.backward()
    assert loss.item() == pytest.approx(c["loss"], rel=1e-12)
    torch.testing.assert_close(mean.grad, torch.tensor(c["dloss_dmean"], dtype=torch.float64), rtol=1e-12, atol=0)


def test_the_reference_cases_are_not_trivial():
    # a loss of 0 or a shared std would make the comparison above blind to the 2 std^2 per sample
    losses = [c["loss"] for c in REFERENCE["cases"]]
    assert all(v > 1e-3 for v in losses) and len(set(losses)) == len(losses)
    assert any(len(set(c["std_dev_t"])) > 1 for c in REFERENCE["cases"])
