"""Engines: one per loaded model, on its own thread, driving omlx's BatchRunner over mlx-lm models."""
