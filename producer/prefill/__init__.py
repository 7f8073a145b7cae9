"""`producer capture`: a capture pass over a finished run's answers (common/prefill.py)."""
