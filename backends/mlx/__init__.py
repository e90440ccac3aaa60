"""The MLX engine: mlx-lm models on Apple silicon (and MLX's CPU backend)."""
