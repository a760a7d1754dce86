"""One readable file per training algorithm."""
