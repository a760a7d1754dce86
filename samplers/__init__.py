"""Sampling steps with log-probabilities, schedules, guidance and rollout (torch only)."""
