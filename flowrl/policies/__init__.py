"""Adapters that turn a transformers LM or VLM into a token policy: inputs with image placeholders, generation
with per-token log-probs, re-scoring with loss masks, LoRA and the reference model."""

from flowrl.policies.families import FAMILIES, Family, family_for_model_type
from flowrl.policies.inputs import PolicyInputs, Turn, build_inputs
from flowrl.policies.policy import Generation, PolicyLoadError, TokenPolicy

__all__ = ["FAMILIES", "Family", "Generation", "PolicyInputs", "PolicyLoadError", "TokenPolicy", "Turn",
           "build_inputs", "family_for_model_type"]
