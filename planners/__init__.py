"""Route-size policy, per-SM geometry model and the decode / prefill plans (pure Python)."""
