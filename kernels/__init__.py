"""kvgate kernels package."""
