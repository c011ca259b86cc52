"""Numerics: no model knowledge, no Ray."""
