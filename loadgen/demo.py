"""``kvgate demo``: placeholder until the fleet runner lands (next commit)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvgate demo``."""


def main(args: argparse.Namespace) -> int:
    """Not wired yet."""
    print("kvgate demo: not available yet")
    return 2
