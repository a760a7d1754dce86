"""Multi-turn environments for agents: observations (text and images), tools, rewards, and the rollout loop."""
