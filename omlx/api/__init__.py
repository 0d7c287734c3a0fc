"""The HTTP layer: one Sanic blueprint per protocol. Nothing here touches mlx."""
