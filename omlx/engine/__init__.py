"""Engines: one per loaded model, on its own thread, around mlx-lm's BatchGenerator."""
