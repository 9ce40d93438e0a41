#!/usr/bin/env bash
# Build a real Kubernetes v1.20.2 control plane and node for the end-to-end tests (tests/e2e/), and
# link it at <repo>/.tools/kube.
#
# Everything comes from Debian 12 (bookworm), through apt's own clients and signature chain:
#   - kube-apiserver, kube-scheduler, kubelet: built from Debian's `kubernetes` source package with
#     Debian's Go 1.19 (golang-1.19-go/-src, unpacked with dpkg -x, nothing installed). The vendored
#     modern-go/reflect2 1.0.1 crashes under Go >= 1.18 (fatal error in mapiterinit), so it and
#     json-iterator/go are replaced by the sources of Debian's reflect2 1.0.2 and json-iterator 1.1.12.
#   - etcd and etcdctl: taken out of Debian's etcd-server and etcd-client packages.
#   - the local test image (no registry is reachable from the tests): a static pause built with
#     gcc -static from scripts/kube/pause.c plus busybox from busybox-static, packed as a
#     `docker save` tarball by scripts/kube/mkimage.py, for `ctr images import`.
#   - containerd, runc and containernetworking-plugins, installed with apt-get (for the kubelet tests).
# Every downloaded file is checked against the SHA256 pinned below (apt also checks it against the
# signed Debian indexes). apt runs with a private sources list and lists directory under the cache,
# so the system's apt configuration is left as it is.
#
# The result is cached in ~/.cache/gpunode/kube-v1.20.2-<hash of the pins>/ (GPUNODE_KUBE_CACHE
# overrides ~/.cache/gpunode); a run that finds a complete cache only re-checks the binaries'
# digests and relinks .tools/kube (GPUNODE_KUBE_LINK overrides). Idempotent; concurrent runs wait for
# each other (flock). `get-kube.sh --print-cache-dir` prints the cache directory and does nothing else.
# A cold build takes a few minutes of 2 cores; the Go build runs under nice.
set -Eeuo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

KUBE_VERSION="v1.20.2"
KUBE_SRC_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
RECIPE_REV=1  # bump when the build steps change in a way that changes the binaries
# name=version of every .deb fetched with apt-get download.
DEBS=(
  golang-1.19-go=1.19.8-2
  golang-1.19-src=1.19.8-2
  etcd-server=3.4.23-4+b4
  etcd-client=3.4.23-4+b4
  golang-github-modern-go-reflect2-dev=1.0.2-2
  golang-github-json-iterator-go-dev=1.1.12-1
  busybox-static=1:1.35.0-4+deb12u1+b1
)
# sha256 of every downloaded file (the kubernetes source package's three files, then the .debs).
PINS="
19fa1da5aefcef673894ac9511986bd98a14410cf8eea0b626613c30df435257  kubernetes_1.20.5+really1.20.2-1.1+deb12u1.dsc
b83c0780efb182d928dc63d46488a847f161f04e40a94b96bf5247dd671ecdfc  kubernetes_1.20.5+really1.20.2.orig.tar.gz
9b6e5fd41769d2b5badf2e73b274e3bcd90f85e13d06a1a4a845ccce018127d8  kubernetes_1.20.5+really1.20.2-1.1+deb12u1.debian.tar.xz
545123039b6c79e75cf2d86528781a825424cf33ce9d3f4513d772d7144cd531  golang-1.19-go_1.19.8-2_amd64.deb
2dfa82fe4f08f4e0193c532e561af4c91871f5235608f04f2bb8d57bb288df5a  golang-1.19-src_1.19.8-2_all.deb
3a9445d4560ad6de1c375756b2a17d97713df44cbd20a658c871fe108af7ef5d  etcd-server_3.4.23-4+b4_amd64.deb
db3a484d5d924b50bf71f459ee544ecd7b11c25dc2f6becc0c50352d67299cc8  etcd-client_3.4.23-4+b4_amd64.deb
af150a5172cf4c19bb321a53e67103e7fb18d07c1baa1e816a235155265d3948  golang-github-modern-go-reflect2-dev_1.0.2-2_all.deb
b03bbfae7e679be899cd583e2560de92e652979c40a8c44816ff8c8d25e1a5fe  golang-github-json-iterator-go-dev_1.1.12-1_all.deb
3d3fdbe91d4660c873e14b092c213fe81c1da6362daa236eb25d0171eb108744  busybox-static_1%3a1.35.0-4+deb12u1+b1_amd64.deb
"
BINARIES=(kube-apiserver kube-scheduler kubelet etcd etcdctl)
NODE_PACKAGES=(containerd runc containernetworking-plugins)
IMAGE_REF="gpunode.local/pause-busybox:1"

KEY="$(printf '%s\n' "$KUBE_VERSION" "$KUBE_SRC_VERSION" "$RECIPE_REV" "${DEBS[@]}" "$PINS" | sha256sum | cut -c1-12)"
CACHE_ROOT="${GPUNODE_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpunode}"
CACHE="$CACHE_ROOT/kube-$KUBE_VERSION-$KEY"
LINK="${GPUNODE_KUBE_LINK:-$ROOT/.tools/kube}"
STEP="starting"
if [ "${1:-}" = --print-cache-dir ]; then echo "$CACHE"; exit 0; fi

fail() {  # one line naming the problem, one with the fix
  echo "get-kube.sh: $1" >&2
  echo "HINT: $2" >&2
  exit 1
}
on_error() {
  echo "get-kube.sh: failed while $STEP${LOG:+ (log: $LOG)}" >&2
  echo "HINT: fix the cause above and run scripts/get-kube.sh again; nothing half-built is used" >&2
}
trap on_error ERR

[ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] ||
  fail "the pinned packages are for linux-amd64; this is $(uname -s)-$(uname -m)" \
    "run the e2e tests on an amd64 Debian 12 machine"
# shellcheck disable=SC1091
codename="$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")"
[ "$codename" = bookworm ] ||
  fail "the pinned packages are Debian 12 (bookworm)'s; this system is '${codename:-unknown}'" \
    "run the e2e tests on Debian 12, or update the versions and checksums pinned in scripts/get-kube.sh"

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.kube.lock"
flock 9  # another get-kube.sh may be building the same thing: wait for it

sha_of_bins() { (cd "$CACHE/bin" && sha256sum "${BINARIES[@]}"); }

control_plane_cached() {
  [ -f "$CACHE/bin/SHA256SUMS" ] && (cd "$CACHE/bin" && sha256sum --quiet -c SHA256SUMS >/dev/null 2>&1)
}

# apt with a private sources list (deb + deb-src, copied from the system's Debian entries) and lists.
APT_DIR="$CACHE_ROOT/apt"
apt_private() {
  apt-get -o Dir::Etc::SourceList="$APT_DIR/sources.list" -o Dir::Etc::SourceParts="$APT_DIR/sources.list.d" \
    -o Dir::State::Lists="$APT_DIR/lists" -o Dir::Cache="$APT_DIR/cache" -o Debug::NoLocking=1 \
    -o APT::Sandbox::User=root "$@"
}
write_private_sources() {
  mkdir -p "$APT_DIR/sources.list.d" "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial"
  : >"$APT_DIR/sources.list"
  python3 - "$APT_DIR/sources.list.d/debian.sources" <<'PY'
import glob
import sys

# Copy the system's deb822 entries for Debian's own archive (same mirror, same Signed-By) as deb + deb-src.
stanzas = []
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for block in open(path).read().split("\n\n"):
        fields = {}
        for line in block.splitlines():
            if line.strip() and not line.startswith("#") and ":" in line and not line[0].isspace():
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
        if "deb" in fields.get("Types", "").split() and "debian-archive-keyring" in fields.get("Signed-By", ""):
            fields["Types"] = "deb deb-src"
            fields.pop("Enabled", None)
            stanzas.append("\n".join(f"{k}: {v}" for k, v in fields.items()))
if not stanzas:
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    for uri, suites in (("http://deb.debian.org/debian", "bookworm bookworm-updates"),
                        ("http://deb.debian.org/debian-security", "bookworm-security")):
        stanzas.append(f"Types: deb deb-src\nURIs: {uri}\nSuites: {suites}\nComponents: main\nSigned-By: {keyring}")
open(sys.argv[1], "w").write("\n\n".join(stanzas) + "\n")
PY
}

fetch_sources() {
  DL="$CACHE_ROOT/downloads"
  mkdir -p "$DL"
  if (cd "$DL" && echo "$PINS" | sed '/^$/d' | sha256sum --quiet -c >/dev/null 2>&1); then
    return 0
  fi
  STEP="reading Debian's package indexes"
  write_private_sources
  apt_private -qq update >/dev/null 2>"$CACHE_ROOT/apt-update.err" ||
    fail "apt-get update (private lists for the Kubernetes sources) failed: $(tail -n 1 "$CACHE_ROOT/apt-update.err")" \
      "check that this machine reaches Debian's mirror (the e2e tests are skipped without it)"
  STEP="downloading the kubernetes source package and the .debs"
  (cd "$DL" && apt_private -qq source --download-only "kubernetes=$KUBE_SRC_VERSION" >/dev/null 2>"$DL/err") ||
    fail "apt-get source kubernetes=$KUBE_SRC_VERSION failed: $(tail -n 1 "$DL/err")" \
      "Debian may have replaced that version: update KUBE_SRC_VERSION and the checksums in scripts/get-kube.sh"
  (cd "$DL" && apt_private -qq download "${DEBS[@]}" >/dev/null 2>"$DL/err") ||
    fail "apt-get download failed: $(tail -n 1 "$DL/err")" \
      "Debian may have replaced one of the pinned versions: update DEBS and the checksums in scripts/get-kube.sh"
  STEP="checking the downloads' checksums"
  (cd "$DL" && echo "$PINS" | sed '/^$/d' | sha256sum --quiet -c) ||
    fail "a downloaded file does not have its pinned sha256; nothing was built" \
      "delete $DL and run again; if it persists, Debian changed the file: review and update the pins"
}

build_control_plane() {
  STEP="installing the build tools (rsync, make, patch, xz-utils, gcc) with apt-get"
  ensure_apt_packages rsync make patch xz-utils gcc libc6-dev
  fetch_sources
  local work src gopkgs goroot
  work="$(mktemp -d "$CACHE_ROOT/build.XXXXXX")"
  LOG="$work.log"
  trap 'rm -rf "$work"' EXIT
  STEP="unpacking Go 1.19 and the replacement vendor packages"
  for deb in golang-1.19-go golang-1.19-src; do dpkg -x "$DL/${deb}"_*.deb "$work/go"; done
  for deb in golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev; do
    dpkg -x "$DL/${deb}"_*.deb "$work/gocode"
  done
  goroot="$work/go/usr/lib/go-1.19"
  STEP="unpacking the kubernetes source and applying Debian's patches"
  tar -xzf "$DL/kubernetes_${KUBE_SRC_VERSION%-*}.orig.tar.gz" -C "$work"
  src="$work/kubernetes-${KUBE_VERSION#v}"
  tar -xJf "$DL/kubernetes_${KUBE_SRC_VERSION}.debian.tar.xz" -C "$src"
  while read -r p; do
    [ -n "$p" ] && [ "${p#\#}" = "$p" ] && patch -s -p1 -d "$src" <"$src/debian/patches/$p"
  done <"$src/debian/patches/series"
  STEP="replacing vendored reflect2 and json-iterator (the 1.0.1 reflect2 crashes under Go 1.19)"
  gopkgs="$work/gocode/usr/share/gocode/src/github.com"
  rm -rf "$src/vendor/github.com/modern-go/reflect2" "$src/vendor/github.com/json-iterator/go"
  cp -a "$gopkgs/modern-go/reflect2" "$src/vendor/github.com/modern-go/reflect2"
  cp -a "$gopkgs/json-iterator/go" "$src/vendor/github.com/json-iterator/go"
  STEP="building kube-apiserver, kube-scheduler and kubelet (a few minutes; log: $LOG)"
  echo ">> building Kubernetes $KUBE_VERSION from Debian's source (a few minutes; log: $LOG)"
  (cd "$src" && env PATH="$goroot/bin:$PATH" GOROOT="$goroot" GOCACHE="$work/gocache" GOPATH="$work/gopath" \
    HOME="$work" GOFLAGS= GOPROXY=off CGO_ENABLED=0 KUBE_BUILD_PLATFORMS=linux/amd64 \
    KUBE_GIT_VERSION="$KUBE_VERSION" KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20 KUBE_GIT_TREE_STATE=clean \
    KUBE_GIT_COMMIT=0000000000000000000000000000000000000000 \
    nice -n 5 make WHAT="cmd/kube-apiserver cmd/kube-scheduler cmd/kubelet") >"$LOG" 2>&1 ||
    fail "the Kubernetes build failed: $(grep -m1 -iE 'error|cannot|fatal' "$LOG" || tail -n 1 "$LOG")" \
      "see $LOG (kept); the usual causes are a full disk or a killed build; run scripts/get-kube.sh again"
  STEP="collecting the binaries"
  local out="$CACHE.tmp"
  rm -rf "$out"
  mkdir -p "$out/bin"
  for b in kube-apiserver kube-scheduler kubelet; do
    install -m 0755 "$src/_output/local/bin/linux/amd64/$b" "$out/bin/$b"
  done
  dpkg -x "$DL"/etcd-server_*.deb "$work/etcd"
  dpkg -x "$DL"/etcd-client_*.deb "$work/etcd"
  install -m 0755 "$work/etcd/usr/bin/etcd" "$work/etcd/usr/bin/etcdctl" "$out/bin/"
  STEP="checking that the binaries start"
  "$out/bin/kube-apiserver" --version | grep -q "$KUBE_VERSION" ||
    fail "the built kube-apiserver does not report $KUBE_VERSION" "see $LOG"
  (cd "$out/bin" && sha256sum "${BINARIES[@]}" >SHA256SUMS)
  rm -rf "$CACHE"
  mv "$out" "$CACHE"
  rm -rf "$work" "$LOG"
  trap - EXIT
}

build_image() {
  local stamp want
  want="$(cat "$ROOT/scripts/kube/pause.c" "$ROOT/scripts/kube/mkimage.py" | sha256sum | cut -c1-16) $IMAGE_REF"
  stamp="$CACHE/image/STAMP"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$CACHE/image/pause-busybox.tar" ]; then
    return 0
  fi
  STEP="building the local pause+busybox image"
  fetch_sources
  local work
  work="$(mktemp -d)"
  dpkg -x "$DL"/busybox-static_*.deb "$work/bb"
  gcc -static -O2 -o "$work/pause" "$ROOT/scripts/kube/pause.c"
  mkdir -p "$CACHE/image"
  python3 "$ROOT/scripts/kube/mkimage.py" "$work/image.tar" "$IMAGE_REF" "$work/pause" "$work/bb/bin/busybox"
  mv -f "$work/image.tar" "$CACHE/image/pause-busybox.tar"
  echo "$IMAGE_REF" >"$CACHE/image/REF"
  echo "$want" >"$stamp"
  rm -rf "$work"
}

START=$SECONDS
if control_plane_cached; then
  echo ">> Kubernetes $KUBE_VERSION binaries cached in $CACHE"
else
  build_control_plane
fi
build_image
mkdir -p "$(dirname "$LINK")"
ln -sfn "$CACHE" "$LINK"

STEP="installing containerd, runc and the CNI plugins from Debian"
node_ok=1
ensure_apt_packages "${NODE_PACKAGES[@]}" || node_ok=0
if [ "$node_ok" = 1 ]; then
  echo "kube $KUBE_VERSION (apiserver, scheduler, kubelet, etcd, image $IMAGE_REF) ready at $LINK" \
    "-> $CACHE in $((SECONDS - START))s"
else
  trap - ERR
  fail "control plane ready at $LINK, but containerd/runc/containernetworking-plugins did not install" \
    "install them with apt-get (as root); until then the kubelet e2e tests are skipped"
fi
