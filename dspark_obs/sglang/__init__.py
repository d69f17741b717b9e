"""Launching SGLang DSpark servers and collecting what they emit; not built yet."""
