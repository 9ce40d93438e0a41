#!/usr/bin/env bash
# Build a real Kubernetes cluster's parts for the end-to-end tests (tests/e2e/) from Go modules, and link
# them at <repo>/.tools/kube.
#
# What is built, each from its own wrapper module under scripts/kube/mod/<component>/ (go.mod + go.sum
# committed: the checksum of every module; GOSUMDB checks what the proxy serves against them):
#   - kubernetes: kube-apiserver, kube-controller-manager, kube-scheduler, kubelet from k8s.io/kubernetes,
#     with every staging module (k8s.io/api, k8s.io/client-go, ...) replaced by the same-numbered v0.X.Y
#     (scripts/kube/update-mods.sh writes that list from k8s.io/kubernetes's own go.mod). Built as
#     upstream builds them: CGO_ENABLED=0, -trimpath, tags selinux,notest, the version set through
#     ldflags so that --version and /version report it (gitCommit stays empty: the module proxy does
#     not say which commit a tag is; the modules' checksums in go.sum say what was built);
#   - etcd: etcd (go.etcd.io/etcd/server/v3) and etcdctl;
#   - containerd: containerd, containerd-shim-runc-v2, ctr (tag no_btrfs, no cgo);
#   - runc: cgo with libseccomp (tag seccomp; libseccomp-dev, gcc and pkg-config from apt);
#   - cni: the loopback plugin (the test node's pods use the loopback network only).
# Plus the local test image (no registry is reachable from the tests): a static pause built with
# gcc -static from scripts/kube/pause.c plus busybox from Debian's busybox-static, packed as a
# `docker save` tarball by scripts/kube/mkimage.py, for `ctr images import`.
#
# Go: the machine's `go` when it is at least the newest go directive of the modules; otherwise the
# toolchain the Go project publishes on the module proxy (GOTOOLCHAIN=go$GO_TOOLCHAIN, checked by
# GOSUMDB), started from the machine's go (>= 1.21) or from the newest golang-1.2x-go package Debian 12
# offers (bookworm-backports), unpacked with dpkg -x. GOMODCACHE and GOCACHE are Go's defaults, kept
# between runs.
#
# Each component's binaries are cached in ~/.cache/gpunode/build/<component>-<version>-<hash of its
# module files, the recipe and the Go version>/ (GPUNODE_KUBE_CACHE overrides ~/.cache/gpunode) with a
# SHA256SUMS; the assembled tree is ~/.cache/gpunode/kube-<version>-<hash of all>/ (bin/, cni/, image/),
# linked at .tools/kube (GPUNODE_KUBE_LINK overrides). A run that finds everything cached checks the
# digests and relinks: seconds. Concurrent runs wait for each other (flock). `--print-cache-dir` prints
# the assembled directory and does nothing else (it may need the Go version: see go_env).
# Builds run under nice with `go build -p 2`; each component's cold build time is printed and kept in
# <component dir>/BUILD_SECONDS.
#
# `scripts/get-kube.sh --jobset` builds the JobSet controller instead (sigs.k8s.io/jobset, its main package
# at the module root, from scripts/kube/mod/jobset/: CGO_ENABLED=0, -trimpath, its version through
# ldflags), the same way and cached the same way, and copies beside the binary what the tests install
# with it, taken from that module's own source: the CRD (jobset.x-k8s.io_jobsets.yaml), the manager's
# RBAC (rbac-role.yaml, rbac-leader-election-role.yaml) and its webhook configurations
# (webhook-manifests.yaml with the objectSelector patches webhook-{mutating,validating}-patch.yaml).
# Linked at .tools/jobset (GPUNODE_JOBSET_LINK overrides); tests/e2e/jobset.py runs it.
set -Eeuo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODS="$ROOT/scripts/kube/mod"
# GPUNODE_KUBE_VERSION=1.34 (or 1.37, ...) builds that minor's Kubernetes from scripts/kube/mod/kubernetes-1.34/
# instead of the default (scripts/kube/mod/kubernetes/, 1.36) and links it at .tools/kube-1.34; etcd,
# containerd, runc and CNI stay as pinned. The e2e tests read the same variable (tests/e2e/controlplane.py).
KUBE_MOD=kubernetes
if [ -n "${GPUNODE_KUBE_VERSION:-}" ] &&
  ! grep -qF "k8s.io/kubernetes v$GPUNODE_KUBE_VERSION." "$MODS/kubernetes/go.mod"; then
  KUBE_MOD="kubernetes-$GPUNODE_KUBE_VERSION"
fi
[ -f "$MODS/$KUBE_MOD/go.mod" ] || {
  echo "get-kube.sh: no wrapper module for Kubernetes $GPUNODE_KUBE_VERSION ($MODS/$KUBE_MOD)" >&2
  echo "HINT: write one with scripts/kube/update-mods.sh (GPUNODE_KUBE_VERSION=$GPUNODE_KUBE_VERSION ... kubernetes=v$GPUNODE_KUBE_VERSION.N) or unset GPUNODE_KUBE_VERSION" >&2
  exit 1
}
moddir() { if [ "$1" = kubernetes ]; then echo "$MODS/$KUBE_MOD"; else echo "$MODS/$1"; fi; }
RECIPE_REV=1          # bump when the build steps change in a way that changes the binaries
GO_TOOLCHAIN=1.26.8   # the toolchain fetched from the module proxy when the machine's go is too old
IMAGE_REF="gpunode.local/pause-busybox:1"
BUSYBOX_DEB="busybox-static=1:1.35.0-4+deb12u1+b1"
BUSYBOX_SHA="3d3fdbe91d4660c873e14b092c213fe81c1da6362daa236eb25d0171eb108744"
CACHE_ROOT="${GPUNODE_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpunode}"
LINK="${GPUNODE_KUBE_LINK:-$ROOT/.tools/kube${KUBE_MOD#kubernetes}}"
STEP="starting"
LOG=""

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

# The version a wrapper module requires of its main module ("require <path> <version>").
mod_version() {
  awk -v p="$2" '($1 == p || ($1 == "require" && $2 == p)) { v = ($1 == "require") ? $3 : $2; print v; exit }' \
    "$(moddir "$1")/go.mod"
}
KUBE_VERSION="$(mod_version kubernetes k8s.io/kubernetes)"
ETCD_VERSION="$(mod_version etcd go.etcd.io/etcd/server/v3)"
CONTAINERD_VERSION="$(mod_version containerd github.com/containerd/containerd/v2)"
RUNC_VERSION="$(mod_version runc github.com/opencontainers/runc)"
CNI_VERSION="$(mod_version cni github.com/containernetworking/plugins)"
JOBSET_VERSION="$(mod_version jobset sigs.k8s.io/jobset)"

# -- Go ------------------------------------------------------------------------------------------------

version_ge() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$2" ]; }

# Sets GO (the go command to run) and GOENV_ARGS (env assignments: GOTOOLCHAIN, GOFLAGS, ...).
go_env() {
  local need have="" sys_go
  need="$(awk '$1 == "go" { print $2 }' "$MODS"/{etcd,containerd,runc,cni,jobset,$KUBE_MOD}/go.mod | sort -V | tail -n1)"
  sys_go="$(command -v go || true)"
  [ -z "$sys_go" ] && [ -x /usr/local/go/bin/go ] && sys_go=/usr/local/go/bin/go
  if [ -n "$sys_go" ]; then
    have="$(GOTOOLCHAIN=local "$sys_go" env GOVERSION 2>/dev/null || true)"
    have="${have#go}"
  fi
  GOENV_ARGS=(GOFLAGS="-mod=readonly -buildvcs=false" GOWORK=off GO111MODULE=on)
  if [ -n "$have" ] && version_ge "$have" "$need"; then
    GO="$sys_go"
    GOENV_ARGS+=(GOTOOLCHAIN=local)
    return 0
  fi
  version_ge "$GO_TOOLCHAIN" "$need" ||
    fail "the modules need Go $need, above the pinned toolchain go$GO_TOOLCHAIN" \
      "raise GO_TOOLCHAIN in scripts/get-kube.sh to at least $need"
  if [ -n "$have" ] && version_ge "$have" 1.21; then
    GO="$sys_go"
  else
    debian_go  # sets GO
  fi
  echo ">> Go ${have:-(none)} is older than the modules' go $need: using go$GO_TOOLCHAIN from the module proxy"
  GOENV_ARGS+=(GOTOOLCHAIN="go$GO_TOOLCHAIN")
}

# The newest golang-1.2x-go Debian 12 offers (bookworm-backports), unpacked into the cache; sets GO to its go.
debian_go() {
  STEP="finding a Go >= 1.21 in Debian (to start go$GO_TOOLCHAIN from the module proxy)"
  write_private_sources backports
  apt_private -qq update >/dev/null 2>"$CACHE_ROOT/apt-update.err" ||
    fail "no Go on this machine is new enough, and apt-get update failed: $(tail -n 1 "$CACHE_ROOT/apt-update.err")" \
      "install Go >= 1.21 (https://go.dev/dl/) or let this machine reach Debian's mirror"
  local pkg
  pkg="$(apt_private -qq list 'golang-1.[2-9][0-9]-go' 2>/dev/null | cut -d/ -f1 | sort -V | tail -n1)"
  [ -n "$pkg" ] ||
    fail "Debian offers no golang-1.2x-go package here (bookworm-backports), and this machine's Go is older than 1.21" \
      "install Go >= 1.21 (https://go.dev/dl/); the e2e tests are skipped until then"
  local dir="$CACHE_ROOT/debian-go/$pkg"
  if [ ! -x "$dir/go/bin/go" ]; then
    mkdir -p "$dir"
    (cd "$dir" && apt_private -qq download "$pkg" >/dev/null 2>"$dir/err") ||
      fail "apt-get download $pkg failed: $(tail -n 1 "$dir/err")" "check this machine's access to Debian's mirror"
    dpkg -x "$dir"/"$pkg"_*.deb "$dir/x"
    ln -sfn "$(dirname "$(dirname "$(find "$dir/x/usr/lib" -path '*/bin/go' -type f | head -n1)")")" "$dir/go"
  fi
  GO="$dir/go/bin/go"
}

# apt with a private sources list and lists directory, so the system's apt configuration stays as it is.
APT_DIR="$CACHE_ROOT/apt"
apt_private() {
  apt-get -o Dir::Etc::SourceList="$APT_DIR/sources.list" -o Dir::Etc::SourceParts="$APT_DIR/sources.list.d" \
    -o Dir::State::Lists="$APT_DIR/lists" -o Dir::Cache="$APT_DIR/cache" -o Debug::NoLocking=1 \
    -o APT::Sandbox::User=root "$@"
}
write_private_sources() {  # [backports]: add bookworm-backports
  mkdir -p "$APT_DIR/sources.list.d" "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial"
  : >"$APT_DIR/sources.list"
  python3 - "$APT_DIR/sources.list.d/debian.sources" "${1:-}" <<'PY'
import glob
import sys

# Copy the system's deb822 entries for Debian's own archive (same mirror, same Signed-By).
stanzas = []
keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
uri = "http://deb.debian.org/debian"
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for block in open(path).read().split("\n\n"):
        fields = {}
        for line in block.splitlines():
            if line.strip() and not line.startswith("#") and ":" in line and not line[0].isspace():
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
        if "deb" in fields.get("Types", "").split() and "debian-archive-keyring" in fields.get("Signed-By", ""):
            fields.pop("Enabled", None)
            stanzas.append("\n".join(f"{k}: {v}" for k, v in fields.items()))
            if "security" not in fields.get("URIs", ""):
                uri, keyring = fields["URIs"].split()[0], fields["Signed-By"]
if not stanzas:
    stanzas.append(f"Types: deb\nURIs: {uri}\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: {keyring}")
if sys.argv[2] == "backports":
    stanzas.append(f"Types: deb\nURIs: {uri}\nSuites: bookworm-backports\nComponents: main\nSigned-By: {keyring}")
open(sys.argv[1], "w").write("\n\n".join(stanzas) + "\n")
PY
}

# -- components ---------------------------------------------------------------------------------------

# The flags each component is built with (part of its cache key).
component_recipe() {
  local c="$1"
  case "$c" in
    kubernetes)
      local minor ldflags="-s -w" p date
      minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
      date="$(module_time k8s.io/kubernetes "$KUBE_VERSION")"
      for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
        ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=$date"
      done
      RECIPE=(
        "CGO_ENABLED=0|selinux notest|$ldflags|./|k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet"
      )
      OUTPUTS=(kube-apiserver kube-controller-manager kube-scheduler kubelet) ;;
    etcd)
      local p="-s -w"
      RECIPE=(
        "CGO_ENABLED=0||$p|etcd|go.etcd.io/etcd/server/v3"
        "CGO_ENABLED=0||$p|etcdctl|go.etcd.io/etcd/etcdctl/v3"
      )
      OUTPUTS=(etcd etcdctl) ;;
    containerd)
      local pkg=github.com/containerd/containerd/v2 v
      v="-s -w -X $pkg/version.Version=$CONTAINERD_VERSION -X $pkg/version.Package=github.com/containerd/containerd/v2"
      RECIPE=(
        "CGO_ENABLED=0|no_btrfs|$v|./|$pkg/cmd/containerd $pkg/cmd/ctr"
        "CGO_ENABLED=0|no_btrfs no_grpc|$v|containerd-shim-runc-v2|$pkg/cmd/containerd-shim-runc-v2"
      )
      OUTPUTS=(containerd ctr containerd-shim-runc-v2) ;;
    runc)
      RECIPE=(
        "CGO_ENABLED=1|seccomp urfave_cli_no_docs|-s -w|runc|github.com/opencontainers/runc"
      )
      OUTPUTS=(runc) ;;
    cni)
      RECIPE=(
        "CGO_ENABLED=0||-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$CNI_VERSION|loopback|github.com/containernetworking/plugins/plugins/main/loopback"
      )
      OUTPUTS=(loopback) ;;
    jobset)
      local v=sigs.k8s.io/jobset/pkg/version
      RECIPE=(
        "CGO_ENABLED=0||-s -w -X $v.GitVersion=$JOBSET_VERSION -X $v.GitCommit=|jobset-controller|sigs.k8s.io/jobset"
      )
      OUTPUTS=(jobset-controller) ;;
  esac
}

# Files a component ships beside its binaries, copied from its module's source in the module cache:
# "<path in the module> <name in the cache directory>" (checked by SHA256SUMS like the binaries).
component_files() {
  case "$1" in
    jobset)
      FILES=(
        "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml jobset.x-k8s.io_jobsets.yaml"
        "config/components/rbac/role.yaml rbac-role.yaml"
        "config/components/rbac/leader_election_role.yaml rbac-leader-election-role.yaml"
        "config/components/webhook/manifests.yaml webhook-manifests.yaml"
        "config/components/webhook/patches/mutating-patch.yaml webhook-mutating-patch.yaml"
        "config/components/webhook/patches/validating-patch.yaml webhook-validating-patch.yaml"
      ) ;;
    *) FILES=() ;;
  esac
}

# The module's publication time on the proxy (the binaries' buildDate: the same on every rebuild).
module_time() {
  local info
  info="$(cd "$(moddir kubernetes)" && env "${GOENV_ARGS[@]}" "$GO" list -m -json "$1" 2>/dev/null)" || true
  python3 -c 'import json,sys; print(json.loads(sys.argv[1] or "{}").get("Time", "1970-01-01T00:00:00Z"))' "$info"
}

component_version() {
  case "$1" in
    kubernetes) echo "$KUBE_VERSION" ;; etcd) echo "$ETCD_VERSION" ;; containerd) echo "$CONTAINERD_VERSION" ;;
    runc) echo "$RUNC_VERSION" ;; cni) echo "$CNI_VERSION" ;; jobset) echo "$JOBSET_VERSION" ;;
  esac
}

main_module() {
  case "$1" in
    kubernetes) echo k8s.io/kubernetes ;; etcd) echo go.etcd.io/etcd/server/v3 ;;
    containerd) echo github.com/containerd/containerd/v2 ;; runc) echo github.com/opencontainers/runc ;;
    cni) echo github.com/containernetworking/plugins ;; jobset) echo sigs.k8s.io/jobset ;;
  esac
}

component_dir() {
  local c="$1" key
  component_recipe "$c"
  key="$(
    {
      cat "$(moddir "$c")/go.mod" "$(moddir "$c")/go.sum" "$(moddir "$c")/tools.go"
      component_files "$c"
      printf '%s\n' "$RECIPE_REV" "$GOVERSION" "${RECIPE[@]}" "${FILES[@]}"
    } | sha256sum | cut -c1-12
  )"
  echo "$CACHE_ROOT/build/$c-$(component_version "$c")-$key"
}

cached() { [ -f "$1/SHA256SUMS" ] && (cd "$1" && sha256sum --quiet -c SHA256SUMS >/dev/null 2>&1); }

build_component() {
  local c="$1" dir out start line cgo tags ldflags o pkgs
  dir="$(component_dir "$c")"
  component_recipe "$c"  # RECIPE, OUTPUTS (component_dir ran in a subshell)
  if cached "$dir"; then
    return 0
  fi
  [ "$c" = runc ] && ensure_apt_packages libseccomp-dev pkg-config gcc libc6-dev
  out="$dir.tmp"
  rm -rf "$out"
  mkdir -p "$out"
  LOG="$CACHE_ROOT/build/$c.log"
  STEP="building $c $(component_version "$c") (log: $LOG)"
  echo ">> building $c $(component_version "$c") from Go modules (cold: minutes; log: $LOG)"
  start=$SECONDS
  : >"$LOG"
  for line in "${RECIPE[@]}"; do
    IFS='|' read -r cgo tags ldflags o pkgs <<<"$line"
    local target="$out/$o"
    [ "$o" = ./ ] && target="$out/"
    # shellcheck disable=SC2086  # pkgs is a list
    (cd "$(moddir "$c")" && env "${GOENV_ARGS[@]}" "$cgo" nice -n 10 "$GO" build -p 2 -trimpath \
      ${tags:+-tags "${tags// /,}"} -ldflags "$ldflags" -o "$target" $pkgs) >>"$LOG" 2>&1 ||
      fail "building $c failed: $(grep -v '^go: downloading' "$LOG" | grep -m1 . || echo "see the log")" \
        "see $LOG; 'module lookup disabled' or a network error: let this machine reach the Go module proxy (GOPROXY); 'missing go.sum entry' or 'verifying': run scripts/kube/update-mods.sh"
  done
  for o in "${OUTPUTS[@]}"; do [ -x "$out/$o" ] || fail "building $c produced no $o" "see $LOG"; done
  component_files "$c"
  local f src names=() mod
  if [ "${#FILES[@]}" -gt 0 ]; then
    mod="$(cd "$(moddir "$c")" && env "${GOENV_ARGS[@]}" "$GO" list -m -f '{{.Dir}}' "$(main_module "$c")")"
    for f in "${FILES[@]}"; do
      src="${f%% *}"
      [ -f "$mod/$src" ] || fail "$c's module ($mod) has no $src" \
        "its layout changed: update component_files in scripts/get-kube.sh for $(component_version "$c")"
      cp "$mod/$src" "$out/${f#* }"
      chmod 0644 "$out/${f#* }"
      names+=("${f#* }")
    done
  fi
  echo "$((SECONDS - start))" >"$out/BUILD_SECONDS"
  (cd "$out" && sha256sum "${OUTPUTS[@]}" "${names[@]}" >SHA256SUMS)
  rm -rf "$dir"
  mv "$out" "$dir"
  echo ">> $c $(component_version "$c") built in $((SECONDS - start))s"
}

build_image() {
  local dest="$1" stamp want
  want="$(cat "$ROOT/scripts/kube/pause.c" "$ROOT/scripts/kube/mkimage.py" | sha256sum | cut -c1-16) $IMAGE_REF $BUSYBOX_SHA"
  stamp="$dest/STAMP"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$dest/pause-busybox.tar" ]; then
    return 0
  fi
  STEP="building the local pause+busybox image"
  ensure_apt_packages gcc libc6-dev
  local dl="$CACHE_ROOT/downloads" deb
  mkdir -p "$dl"
  deb="$(find "$dl" -maxdepth 1 -name 'busybox-static_*.deb' | head -n1)"
  if [ -z "$deb" ] || [ "$(sha256sum "$deb" | cut -d' ' -f1)" != "$BUSYBOX_SHA" ]; then
    write_private_sources
    apt_private -qq update >/dev/null 2>"$CACHE_ROOT/apt-update.err" ||
      fail "apt-get update (private lists, for busybox-static) failed: $(tail -n 1 "$CACHE_ROOT/apt-update.err")" \
        "check that this machine reaches Debian's mirror"
    (cd "$dl" && apt_private -qq download "$BUSYBOX_DEB" >/dev/null 2>"$dl/err") ||
      fail "apt-get download $BUSYBOX_DEB failed: $(tail -n 1 "$dl/err")" \
        "Debian may have replaced that version: update BUSYBOX_DEB and BUSYBOX_SHA in scripts/get-kube.sh"
    deb="$(find "$dl" -maxdepth 1 -name 'busybox-static_*.deb' | head -n1)"
    [ "$(sha256sum "$deb" | cut -d' ' -f1)" = "$BUSYBOX_SHA" ] ||
      fail "$deb does not have its pinned sha256" "delete it and run again; if it persists, review and update BUSYBOX_SHA"
  fi
  local work
  work="$(mktemp -d)"
  dpkg -x "$deb" "$work/bb"
  gcc -static -O2 -o "$work/pause" "$ROOT/scripts/kube/pause.c"
  mkdir -p "$dest"
  python3 "$ROOT/scripts/kube/mkimage.py" "$work/image.tar" "$IMAGE_REF" "$work/pause" "$work/bb/bin/busybox"
  mv -f "$work/image.tar" "$dest/pause-busybox.tar"
  echo "$IMAGE_REF" >"$dest/REF"
  echo "$want" >"$stamp"
  rm -rf "$work"
}

# -- main ---------------------------------------------------------------------------------------------

[ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] ||
  fail "the e2e cluster is built for linux-amd64; this is $(uname -s)-$(uname -m)" \
    "run the e2e tests on an amd64 Debian 12 machine"
COMPONENTS=(kubernetes etcd containerd runc cni)
mkdir -p "$CACHE_ROOT/build"
exec 9>"$CACHE_ROOT/.kube.lock"
flock 9  # another get-kube.sh may be building the same thing: wait for it

START=$SECONDS
go_env
GOVERSION="$(env "${GOENV_ARGS[@]}" "$GO" env GOVERSION 2>/dev/null)" ||
  fail "the Go toolchain did not start ($GO with ${GOENV_ARGS[*]})" \
    "check that this machine reaches the Go module proxy (GOPROXY) or install Go >= 1.21"
if [ "${1:-}" = --jobset ]; then
  JOBSET_LINK="${GPUNODE_JOBSET_LINK:-$ROOT/.tools/jobset}"
  build_component jobset
  dir="$(component_dir jobset)"
  mkdir -p "$(dirname "$JOBSET_LINK")"
  ln -sfn "$dir" "$JOBSET_LINK"
  echo "JobSet controller $JOBSET_VERSION (built in $(cat "$dir/BUILD_SECONDS")s when cold) ready at" \
    "$JOBSET_LINK -> $dir in $((SECONDS - START))s"
  exit 0
fi
dirs=()
for c in "${COMPONENTS[@]}"; do dirs+=("$(component_dir "$c")"); done
KEY="$(printf '%s\n' "${dirs[@]}" "$IMAGE_REF" "$BUSYBOX_SHA" | sha256sum | cut -c1-12)"
CACHE="$CACHE_ROOT/kube-$KUBE_VERSION-$KEY"
if [ "${1:-}" = --print-cache-dir ]; then echo "$CACHE"; exit 0; fi

if cached "$CACHE/bin" && cached "$CACHE/cni"; then
  echo ">> Kubernetes $KUBE_VERSION, etcd $ETCD_VERSION, containerd $CONTAINERD_VERSION, runc $RUNC_VERSION cached in $CACHE"
else
  for c in "${COMPONENTS[@]}"; do build_component "$c"; done
  STEP="assembling $CACHE"
  out="$CACHE.tmp"
  rm -rf "$out"
  mkdir -p "$out/bin" "$out/cni"
  for c in "${COMPONENTS[@]}"; do
    dir="$(component_dir "$c")"
    component_recipe "$c"
    dest="$out/bin"
    [ "$c" = cni ] && dest="$out/cni"
    for o in "${OUTPUTS[@]}"; do cp -l "$dir/$o" "$dest/$o" 2>/dev/null || cp "$dir/$o" "$dest/$o"; done
    printf '%s %s %ss\n' "$c" "$(component_version "$c")" "$(cat "$dir/BUILD_SECONDS")" >>"$out/BUILD_SECONDS"
  done
  STEP="checking that the binaries start"
  "$out/bin/kube-apiserver" --version | grep -qx "Kubernetes $KUBE_VERSION" ||
    fail "the built kube-apiserver does not report $KUBE_VERSION" "see $CACHE_ROOT/build/kubernetes.log"
  cat >"$out/VERSIONS" <<EOF
kubernetes $KUBE_VERSION
etcd $ETCD_VERSION
containerd $CONTAINERD_VERSION
runc $RUNC_VERSION
cni-plugins $CNI_VERSION
go $GOVERSION
EOF
  (cd "$out/bin" && sha256sum -- * >SHA256SUMS)
  (cd "$out/cni" && sha256sum -- * >SHA256SUMS)
  rm -rf "$CACHE"
  mv "$out" "$CACHE"
fi
build_image "$CACHE/image"
mkdir -p "$(dirname "$LINK")"
ln -sfn "$CACHE" "$LINK"
echo "Kubernetes $KUBE_VERSION (apiserver, controller-manager, scheduler, kubelet), etcd $ETCD_VERSION," \
  "containerd $CONTAINERD_VERSION, runc $RUNC_VERSION, CNI $CNI_VERSION, image $IMAGE_REF ready at $LINK" \
  "-> $CACHE in $((SECONDS - START))s"
