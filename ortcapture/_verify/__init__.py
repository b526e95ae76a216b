"""Verification: comparing captured replays with a reference, and what the model alone says about capture."""
