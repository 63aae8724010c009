"""``python -m benchmarks NAME [flags]``: run ``benchmarks.NAME`` with ``flags``; no name lists the benchmarks."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from benchmarks import NAMES


def main(argv: Sequence[str] | None = None) -> int:
    """Run the named benchmark as ``python -m benchmarks.NAME`` would; returns the exit status.

    Args:
        argv: ``[NAME, *flags]``; ``sys.argv[1:]`` when ``None``.

    Returns:
        2 with the list of names on stderr for no name or an unknown one; otherwise what the benchmark's
        ``main`` returns (0 for ``None``; a ``SystemExit`` it raises, e.g. for a bad flag, propagates).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in NAMES:
        found = f"unknown benchmark {args[0]!r}; " if args else ""
        print(f"usage: python -m benchmarks NAME [flags]; {found}NAME is one of: {', '.join(NAMES)}",
              file=sys.stderr)
        return 2
    name, flags = args[0], args[1:]
    sys.argv = [f"python -m benchmarks.{name}", *flags]  # every benchmark's main() parses sys.argv[1:]
    result: int | None = importlib.import_module(f"benchmarks.{name}").main()
    return result or 0


if __name__ == "__main__":
    sys.exit(main())
