"""kvgate events package."""
