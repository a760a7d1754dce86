"""Modality-agnostic RL math: advantages, credit assignment, policy/KL/preference losses (torch only)."""
