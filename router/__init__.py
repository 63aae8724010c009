"""kvgate router package."""
