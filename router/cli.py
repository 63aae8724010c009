"""The ``kvgate`` console script: one subcommand per part that runs.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int``; the
module turns the parsed arguments into its typed config, so no ``argparse.Namespace`` goes further.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    # (name, module, one-line help)
    ("serve", "router.serve", "Run the cache-aware gateway (OpenAI API) from a YAML config."),
    ("loadgen", "loadgen.cli", "Replay a trace against an OpenAI-compatible endpoint and report."),
    ("worker", "workers.cli", "Run a reference worker (OpenAI API, paged KV manager, KV events; sim engine)."),
    ("demo", "loadgen.demo", "Sim workers + gateway on 127.0.0.1, one trace replay per routing policy."),
)


def _version() -> str:
    """The installed package's version (``pyproject.toml``), or ``unknown`` when run from a tree not installed."""
    try:
        return importlib.metadata.version("kvgate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand's arguments."""
    parser = argparse.ArgumentParser(prog="kvgate", description="Cache-aware request router for LLM fleets.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_text in SUBCOMMANDS:
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub)
        sub.set_defaults(_module=module_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    module_name: str | None = getattr(args, "_module", None)
    if module_name is None:
        parser.print_help()
        return 2
    module = importlib.import_module(module_name)
    result: int = module.main(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
