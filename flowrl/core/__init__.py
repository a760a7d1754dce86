"""Modality-agnostic RL math: advantages, credit assignment, policy/KL/preference losses (torch only)."""

from flowrl.core.advantages import (
    PerPromptStatTracker,
    combine_rewards,
    gae,
    group_advantages,
    rloo_advantages,
    zero_std_fraction,
)
from flowrl.core.estimators import ADVANTAGE_ESTIMATORS, CreditBatch, outcome_advantages, register_estimator
from flowrl.core.losses import (
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    LossOutput,
    aggregate,
    clipped_policy_loss,
    dpo_loss,
    gaussian_kl,
    ipo_loss,
    kl_estimate,
    simpo_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CreditBatch",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "LossOutput",
    "PerPromptStatTracker",
    "aggregate",
    "clipped_policy_loss",
    "combine_rewards",
    "dpo_loss",
    "gae",
    "gaussian_kl",
    "group_advantages",
    "ipo_loss",
    "kl_estimate",
    "outcome_advantages",
    "register_estimator",
    "rloo_advantages",
    "simpo_loss",
    "zero_std_fraction",
]
