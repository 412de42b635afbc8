"""Feedback loop: signals, exploration, abstraction, validation, task pool (SPEC 1.1-1.3)."""
