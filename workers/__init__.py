"""kvgate workers package."""
