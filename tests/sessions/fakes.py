"""Test doubles shared by the session store tests."""


class FakeClock:
    """Injected monotonic clock, seconds; tests move ``now_s`` by hand."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s
