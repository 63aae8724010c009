"""kvgate policies package."""
