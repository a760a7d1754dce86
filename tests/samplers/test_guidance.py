"""Classifier-free guidance: one batched call, v = v_u + w (v_c - v_u)."""

import ast
import sys
from pathlib import Path

import pytest
import torch

from samplers import classifier_free_guidance, linear_sigmas, rollout

B = 3


def _model(record):
    """A velocity function whose output depends on x, sigma and both kinds of condition."""

    def vel(x, sigma, cond):
        record.append((x.shape[0], sigma.shape, cond))
        emb = cond["emb"] if isinstance(cond, dict) else cond
        bias = emb.mean(dim=tuple(range(1, emb.ndim))).reshape((-1,) + (1,) * (x.ndim - 1))
        if isinstance(cond, dict):
            bias = bias + cond["pooled"][:, :1].reshape(bias.shape)
        return x * sigma.reshape(bias.shape) + bias

    return vel


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 2, 3, 3, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.2])
    cond = torch.randn(B, 5, 4, generator=g)
    uncond = torch.zeros(1, 5, 4)
    return x, sigma, cond, uncond


def test_guidance_formula_and_single_batched_call():
    x, sigma, cond, uncond = _data()
    calls = []
    model = _model(calls)
    w = 4.5
    v = classifier_free_guidance(model, uncond, w)(x, sigma, cond)
    assert len(calls) == 1 and calls[0][0] == 2 * B and calls[0][1] == (2 * B,)
    v_c = model(x, sigma, cond)
    v_u = model(x, sigma, uncond.expand(B, 5, 4))
    assert torch.allclose(v, v_u + w * (v_c - v_u), atol=1e-6)
    # uncond with batch B is used as is
    v2 = classifier_free_guidance(model, uncond.expand(B, 5, 4).clone(), w)(x, sigma, cond)
    assert torch.allclose(v, v2, atol=1e-6)
    with pytest.raises(ValueError, match="batch"):
        classifier_free_guidance(model, torch.zeros(2, 5, 4), w)(x, sigma, cond)


def test_scale_one_is_one_undoubled_call():
    x, sigma, cond, uncond = _data()
    calls = []
    model = _model(calls)
    v = classifier_free_guidance(model, uncond, 1.0)(x, sigma, cond)
    assert len(calls) == 1 and calls[0][0] == B
    assert torch.equal(v, model(x, sigma, cond))


def test_dict_condition_and_per_sample_scale():
    x, sigma, cond, _ = _data()
    g = torch.Generator().manual_seed(1)
    c = {"emb": cond, "pooled": torch.randn(B, 4, generator=g)}
    u = {"emb": torch.zeros(1, 5, 4), "pooled": torch.zeros(1, 4)}
    calls = []
    model = _model(calls)
    w = torch.tensor([1.0, 3.0, 7.0])
    v = classifier_free_guidance(model, u, w)(x, sigma, c)
    assert len(calls) == 1 and calls[0][2]["pooled"].shape == (2 * B, 4)
    v_c = model(x, sigma, c)
    v_u = model(x, sigma, {k: t.expand(B, *t.shape[1:]) for k, t in u.items()})
    assert torch.allclose(v, v_u + w.reshape(B, 1, 1, 1) * (v_c - v_u), atol=1e-5)
    with pytest.raises(ValueError, match="keys"):
        classifier_free_guidance(model, {"emb": u["emb"]}, 2.0)(x, sigma, c)


def test_guided_rollout_uses_the_same_wrapper():
    x, _, cond, uncond = _data()
    calls = []
    guided = classifier_free_guidance(_model(calls), uncond, 3.0)
    traj = rollout(guided, x, linear_sigmas(4), cond=cond, sample_seeds=torch.arange(B))
    assert len(calls) == 4 and all(c[0] == 2 * B for c in calls)
    v = guided(traj.latents[:, 1], traj.sigmas[1].expand(B), cond)
    assert torch.equal(traj.score_step(v, 1).log_prob, traj.log_probs[:, 1])


def test_package_imports_only_torch_numpy_stdlib():
    """docs/architecture.md: samplers depends on torch (and numpy) only. Checked statically on every import
    statement of the package (a subprocess import would cost seconds on a busy machine)."""
    pkg = Path(__file__).resolve().parents[2] / "samplers"
    allowed = {"torch", "numpy"} | set(sys.stdlib_module_names)
    found = set()
    for path in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {(path.name, a.name.split(".")[0]) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add((path.name, node.module.split(".")[0]))
    bad = sorted((f, m) for f, m in found if m not in allowed)
    assert not bad, bad
    assert ("steps.py", "torch") in found
