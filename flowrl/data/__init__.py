"""Prompt sets, the shapes world, webdataset I/O and the prompt groups (PromptGroups)."""
