"""kvgate loadgen package."""
