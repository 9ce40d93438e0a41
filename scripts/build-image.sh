#!/usr/bin/env bash
# Build the gpunode image from ./Containerfile with buildah: `scripts/build-image.sh [TAG]`
# (TAG defaults to gpunode:<version in pyproject.toml>). tests/deploy/test_image.py runs it.
#
# GPUNODE_BASE_IMAGE: the FROM of both stages (default: the Containerfile's debian:bookworm-slim);
#   `local` builds a stand-in from Debian's packages first (scripts/image-base.sh), for machines
#   that reach Debian's mirror and PyPI but no container registry.
# PIP_INDEX_URL, PIP_EXTRA_INDEX_URL: passed to the build stage as build arguments.
# PIP_CERT: a CA bundle file (a TLS-intercepting proxy's); mounted read-only into the build's RUN
#   steps and named to pip there.
# RUN steps use buildah's chroot isolation, which needs no OCI runtime and sets no resource limits
# (so it also works inside containers and sandboxes that refuse them); layers are cached, so a
# rebuild with unchanged sources takes seconds.
#
# Needs root; installs Debian's buildah when missing. Prints the image's name as its last line.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$ROOT"
VERSION="$("$PYTHON" -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")"
TAG="${1:-gpunode:$VERSION}"

ensure_apt_packages buildah
args=(--isolation chroot --layers --build-arg "VERSION=$VERSION")
case "${GPUNODE_BASE_IMAGE:-}" in
  "") ;;
  local) args+=(--build-arg "BASE_IMAGE=$(bash "$ROOT/scripts/image-base.sh")") ;;
  *) args+=(--build-arg "BASE_IMAGE=$GPUNODE_BASE_IMAGE") ;;
esac
for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL; do
  if [ -n "${!var:-}" ]; then args+=(--build-arg "$var=${!var}"); fi
done
if [ -n "${PIP_CERT:-}" ]; then
  if [ ! -f "$PIP_CERT" ]; then
    echo "build-image.sh: PIP_CERT names $PIP_CERT, which is not a file; HINT: point it at a CA bundle or unset it" >&2
    exit 1
  fi
  args+=(--volume "$(realpath "$PIP_CERT"):/run/gpunode-build/ca.pem:ro" --build-arg PIP_CERT=/run/gpunode-build/ca.pem)
fi

echo ">> buildah build -f Containerfile -t $TAG (${args[*]})" >&2
buildah build --force-rm "${args[@]}" -f Containerfile -t "$TAG" . >&2
echo "$TAG"
