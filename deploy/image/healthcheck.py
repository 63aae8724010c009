"""The image's HEALTHCHECK: exit 0 when ``GET $KVGATE_HEALTH_URL`` answers 200 within 2 s, else 1.

Run by the container runtime in exec form (no shell in the image is needed); standard library only.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8080/health"


def main() -> int:
    url = os.environ.get("KVGATE_HEALTH_URL", DEFAULT_URL)
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:  # noqa: S310 (a fixed loopback URL)
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"health check of {url} failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
