#!/usr/bin/env bash
# Makes a local base image for deploy/image/Dockerfile without any image registry: a Debian bookworm root file
# system from the Debian package mirror (debootstrap, minbase + python3, python3-venv, ca-certificates), imported
# into podman's local storage as IMAGE. Idempotent: an IMAGE already stored is kept.
#
# Usage: deploy/image/build-base.sh [IMAGE]   (default localhost/kvgate-base:bookworm; needs root, podman, debootstrap)
# Then: podman build --build-arg BASE_IMAGE=localhost/kvgate-base:bookworm -f deploy/image/Dockerfile .
set -euo pipefail
IMAGE=${1:-localhost/kvgate-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if podman image exists "$IMAGE"; then
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$work/rootfs" "$MIRROR" \
  >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
tar -C "$work/rootfs" -c . | podman import --quiet - "$IMAGE" >/dev/null
echo "$IMAGE"
