"""Serving runtime: paged KV pools, ShadowRadix prefix caching, HiSparse, the engine, RL hooks."""
