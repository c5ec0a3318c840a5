"""Bridges from model libraries to kquant_cute (optional extras; nothing here is imported
by the core package). `kquant_cute.integrations.transformers` needs `pip install
kquant-cute[hf]`."""
