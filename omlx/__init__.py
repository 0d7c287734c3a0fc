"""omlx: a local LLM inference server on MLX and mlx-lm."""

__version__ = "0.1.0"
