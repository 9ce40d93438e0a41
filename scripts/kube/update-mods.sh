#!/usr/bin/env bash
# Write the wrapper modules under scripts/kube/mod/ for the versions given, and pin them (go mod tidy
# writes go.sum: the checksum of every module, checked against GOSUMDB). Run by hand to move the e2e
# cluster to other versions, then commit scripts/kube/mod/; scripts/get-kube.sh builds what is pinned.
#
#   scripts/kube/update-mods.sh [kubernetes=v1.36.3] [etcd=v3.6.16] [containerd=v2.2.9] [runc=v1.4.4] [cni=v1.10.0]
#                               [jobset=v0.12.0]
#   GPUNODE_KUBE_VERSION=1.34 scripts/kube/update-mods.sh kubernetes=v1.34.4
#
# The second form writes the wrapper module of another minor (mod/kubernetes-1.34/, copied from
# mod/kubernetes/ the first time) that `GPUNODE_KUBE_VERSION=1.34 scripts/get-kube.sh` builds.
#
# Components not named keep their version. The Kubernetes module requires k8s.io/kubernetes and replaces
# every staging module (those its own go.mod replaces with ./staging/src/...) by the same-numbered v0.X.Y.
set -euo pipefail
MODS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/mod"
GO="${GO:-go}"

declare -A PATHS=(
  [kubernetes]=k8s.io/kubernetes
  [etcd]=go.etcd.io/etcd/server/v3
  [containerd]=github.com/containerd/containerd/v2
  [runc]=github.com/opencontainers/runc
  [cni]=github.com/containernetworking/plugins
  [jobset]=sigs.k8s.io/jobset
)

current() {  # the version the module pins now
  awk -v p="${PATHS[$1]}" '($1 == p || ($1 == "require" && $2 == p)) { print ($1 == "require") ? $3 : $2; exit }' \
    "$(moddir "$1")/go.mod"
}

moddir() {
  if [ "$1" = kubernetes ] && [ -n "${GPUNODE_KUBE_VERSION:-}" ] &&
    ! grep -qF "k8s.io/kubernetes v$GPUNODE_KUBE_VERSION." "$MODS/kubernetes/go.mod"; then
    [ -d "$MODS/kubernetes-$GPUNODE_KUBE_VERSION" ] || {
      mkdir -p "$MODS/kubernetes-$GPUNODE_KUBE_VERSION"
      cp "$MODS/kubernetes/go.mod" "$MODS/kubernetes/tools.go" "$MODS/kubernetes-$GPUNODE_KUBE_VERSION/"
    }
    echo "$MODS/kubernetes-$GPUNODE_KUBE_VERSION"
  else
    echo "$MODS/$1"
  fi
}

write_mod() {
  local c="$1" v="$2" gover gomod="" dir
  dir="$(moddir "$c")"
  if [ "$c" = kubernetes ]; then
    gomod="$(cd / && GOFLAGS=-mod=mod "$GO" mod download -json "k8s.io/kubernetes@$v" |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
  fi
  # The newest go directive among the main module and what the wrapper needs: go mod tidy raises it.
  gover="$(awk '$1 == "go" { print $2 }' "$dir/go.mod")"
  {
    echo "module gpunode/kube/$c"
    echo
    echo "go $gover"
    echo
    case "$c" in
      etcd) printf 'require (\n\tgo.etcd.io/etcd/etcdctl/v3 %s\n\tgo.etcd.io/etcd/server/v3 %s\n)\n' "$v" "$v" ;;
      *) echo "require ${PATHS[$c]} $v" ;;
    esac
    if [ "$c" = kubernetes ]; then
      local staging="v0.${v#v1.}"
      echo
      echo "replace ("
      awk -v s="$staging" '$2 == "=>" && $3 ~ /^\.\/staging\/src\// { print "\t" $1 " => " $1 " " s }' "$gomod" | sort -u
      echo ")"
    fi
  } >"$dir/go.mod"
  : >"$dir/go.sum"
  (cd "$dir" && GOFLAGS=-mod=mod GOWORK=off "$GO" mod tidy)
  echo "$c: ${PATHS[$c]} $v ($(grep -c . "$dir/go.sum") go.sum lines)"
}

for arg in "$@"; do
  c="${arg%%=*}"
  v="${arg#*=}"
  [ -n "${PATHS[$c]:-}" ] && [ "$c" != "$arg" ] || {
    echo "update-mods.sh: '$arg' is not <component>=<version> (components: ${!PATHS[*]})" >&2
    exit 2
  }
  write_mod "$c" "$v"
done
[ "$#" -gt 0 ] || for c in "${!PATHS[@]}"; do echo "$c ${PATHS[$c]} $(current "$c")"; done
