#!/usr/bin/env bash
# A local stand-in for the Containerfile's base image (debian:bookworm-slim), for machines that reach
# Debian's mirror but no container registry. Prints the image's name (localhost/gpunode-base:bookworm-<key>)
# on stdout; everything else goes to stderr.
#
# It is what the official image is made of: `debootstrap --variant=minbase bookworm`, the
# bookworm, bookworm-updates and bookworm-security sources, and the same slimming (dpkg leaves
# documentation, manual pages and translations out). The root filesystem is cached as a tarball in
# ~/.cache/gpunode (GPUNODE_IMAGE_CACHE), the image in buildah's storage; both are keyed by a hash of
# this script, the suite, the mirror and the architecture, so a machine builds it once.
#
# Needs root (debootstrap, buildah); installs Debian's debootstrap and buildah when they are missing.
# GPUNODE_DEBIAN_MIRROR overrides the mirror (http://deb.debian.org/debian).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec 3>&1 1>&2  # progress to stderr; fd 3 carries the image name

SUITE=bookworm
MIRROR="${GPUNODE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
ARCH="$(dpkg --print-architecture)"
CACHE="${GPUNODE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpunode}"
KEY="$( { cat "${BASH_SOURCE[0]}"; echo "$SUITE $MIRROR $ARCH"; } | sha256sum | cut -c1-16)"
IMAGE="localhost/gpunode-base:$SUITE-$KEY"
TARBALL="$CACHE/base-$SUITE-$ARCH-$KEY.tar"

ensure_apt_packages buildah debootstrap

if buildah inspect --type image "$IMAGE" >/dev/null 2>&1; then
  echo ">> base image $IMAGE is already built"
  echo "$IMAGE" >&3
  exit 0
fi

if [ ! -f "$TARBALL" ]; then
  mkdir -p "$CACHE"
  WORK="$(mktemp -d "$CACHE/.rootfs.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
  echo ">> debootstrap --variant=minbase $SUITE from $MIRROR (once per machine)"
  debootstrap --variant=minbase --arch="$ARCH" "$SUITE" "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
    tail -n 20 "$WORK/debootstrap.log"
    echo "image-base.sh: debootstrap failed; HINT: check that $MIRROR is reachable (GPUNODE_DEBIAN_MIRROR)"
    exit 1
  }
  R="$WORK/rootfs"
  # The slim variant's dpkg filter, and what it would have left out of the packages already installed.
  cat >"$R/etc/dpkg/dpkg.cfg.d/slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
path-exclude /usr/share/groff/*
EOF
  find "$R/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$R/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
  rm -rf "$R/usr/share/man/"* "$R/usr/share/info/"* "$R/usr/share/lintian/"* "$R/usr/share/groff/"*
  rm -f "$R/etc/apt/sources.list"
  cat >"$R/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  rm -rf "$R/var/cache/apt/archives/"*.deb "$R/var/cache/apt/"*.bin "$R/var/lib/apt/lists/"* "$R/var/log/"*
  : >"$R/etc/hostname"
  tar --numeric-owner --xattrs -C "$R" -cf "$TARBALL.tmp" .
  mv -f "$TARBALL.tmp" "$TARBALL"
  rm -rf "$WORK"
  trap - EXIT
fi

echo ">> importing $TARBALL as $IMAGE"
CTR="$(buildah from scratch)"
trap 'buildah rm "$CTR" >/dev/null 2>&1 || true' EXIT
MNT="$(buildah mount "$CTR")"
tar --numeric-owner --xattrs -C "$MNT" -xf "$TARBALL"
buildah umount "$CTR" >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd bash \
  --label "org.opencontainers.image.description=debian:$SUITE-slim stand-in, built by scripts/image-base.sh" "$CTR"
buildah commit --quiet "$CTR" "$IMAGE" >/dev/null
echo "$IMAGE" >&3
