"""Shared fixtures: the closed-form velocity field of Gaussian data.

For data x0 ~ N(m, s^2 I) and x = (1 - sigma) x0 + sigma eps, each element of (x0, eps, x) is jointly
Gaussian with Var(x) = V(sigma) = (1 - sigma)^2 s^2 + sigma^2, Cov(x0, x) = (1 - sigma) s^2 and
Cov(eps, x) = sigma. Hence
    E[x0 | x]  = m + (1 - sigma) s^2 / V * (x - (1 - sigma) m)
    E[eps | x] = sigma / V * (x - (1 - sigma) m)
    v(x, sigma) = E[eps - x0 | x] = (sigma - (1 - sigma) s^2) / V * (x - (1 - sigma) m) - m,
which is affine in x. The marginal at sigma is N((1 - sigma) m, V(sigma)), and the exact ODE flow map
sends z ~ N(0, 1) at sigma = 1 to (1 - sigma) m + sqrt(V(sigma)) z. With s = 0 (a point mass) the
velocity predicts x0 and eps exactly.
"""

from __future__ import annotations

import pytest
import torch


class GaussianFlow:
    def __init__(self, m: float = 0.3, s: float = 0.6):
        self.m, self.s = m, s

    def var(self, sigma):
        return (1 - sigma) ** 2 * self.s**2 + sigma**2

    def mean(self, sigma):
        return (1 - sigma) * self.m

    def velocity(self, x: torch.Tensor, sigma, cond=None) -> torch.Tensor:
        """The exact E[v | x]; per element, so every sample is independent of its batch."""
        sig = torch.as_tensor(sigma, dtype=torch.float64, device=x.device)
        if sig.ndim == 1:
            sig = sig.reshape((-1,) + (1,) * (x.ndim - 1))
        xd = x.to(torch.float64)
        V = self.var(sig)
        v = (sig - (1 - sig) * self.s**2) / V * (xd - (1 - sig) * self.m) - self.m
        return v.to(x.dtype)

    __call__ = velocity


@pytest.fixture
def gaussian_flow():
    return GaussianFlow()


@pytest.fixture
def make_gaussian_flow():
    return GaussianFlow


@pytest.fixture(autouse=True)
def _single_thread():
    """These tests use small tensors, for which one intra-op thread is fastest and immune to the
    thread contention of a shared 2-core machine. Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
