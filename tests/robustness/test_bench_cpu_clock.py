"""The gateway benchmark reads another process's CPU time from its kernel CPU clock, exactly."""

import subprocess
import sys

import benchmarks.gateway

_CHILD = """
import sys, time
start = time.process_time()
while time.process_time() - start < 0.05:
    pass
print(repr(time.process_time()), flush=True)
sys.stdin.read()
"""


def test_cpu_seconds_of_another_process_match_its_own_reading() -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        own_s = float(child.stdout.readline())
        seen_s = benchmarks.gateway._cpu_s(child.pid)
    finally:
        child.communicate("")
    # The child's own reading comes last before it blocks: the two differ by the few instructions between them and
    # nothing like the 10 ms of a clock tick.
    assert own_s >= 0.05
    assert 0.0 <= seen_s - own_s < 0.002
