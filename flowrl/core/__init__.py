"""Modality-agnostic RL math: advantages, credit assignment, policy/KL/preference losses, forward-process
objectives and snapshot schedules (torch only)."""

from flowrl.core.advantages import (
    PerPromptStatTracker,
    combine_rewards,
    gae,
    group_advantages,
    rloo_advantages,
    zero_std_fraction,
)
from flowrl.core.diffusion_preference import DGPOOutput, d3po_loss, dgpo_loss, diffusion_dpo_loss
from flowrl.core.estimators import ADVANTAGE_ESTIMATORS, CreditBatch, outcome_advantages, register_estimator
from flowrl.core.forward_losses import (
    ForwardLossOutput,
    awm_loss,
    crd_loss,
    implicit_reward,
    nft_loss,
    reward_weights,
    velocity_error,
)
from flowrl.core.losses import (
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    LossOutput,
    aggregate,
    clipped_policy_loss,
    dpo_loss,
    dppo_policy_loss,
    gaussian_kl,
    ipo_loss,
    kl_estimate,
    ratio_norm_policy_loss,
    simpo_loss,
)
from flowrl.core.snapshots import DecaySchedule, snapshot_decay, update_snapshot_

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CreditBatch",
    "DGPOOutput",
    "DecaySchedule",
    "ForwardLossOutput",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "LossOutput",
    "PerPromptStatTracker",
    "aggregate",
    "awm_loss",
    "clipped_policy_loss",
    "combine_rewards",
    "crd_loss",
    "d3po_loss",
    "dgpo_loss",
    "diffusion_dpo_loss",
    "dpo_loss",
    "dppo_policy_loss",
    "gae",
    "gaussian_kl",
    "group_advantages",
    "implicit_reward",
    "ipo_loss",
    "kl_estimate",
    "ratio_norm_policy_loss",
    "nft_loss",
    "outcome_advantages",
    "register_estimator",
    "reward_weights",
    "rloo_advantages",
    "simpo_loss",
    "snapshot_decay",
    "update_snapshot_",
    "velocity_error",
    "zero_std_fraction",
]
