#!/usr/bin/env bash
# Install everything the tests need (Debian packages, .venv, gpunode with its test extras),
# check lint and types, and run the whole test suite. Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ensure_apt_packages gcc libc6-dev pkg-config libsystemd-dev prometheus valgrind systemd
ensure_venv "[test,systemd]"
echo ">> helm (for the chart tests)"
bash "$ROOT/scripts/get-helm.sh" || echo "!! no helm: the chart tests will be skipped" >&2
echo ">> Kubernetes 1.36, etcd, containerd, runc (for the end-to-end tests in tests/e2e; built once from Go modules, then cached)"
bash "$ROOT/scripts/get-kube.sh" || echo "!! no Kubernetes binaries: the e2e tests will be skipped" >&2
echo ">> the JobSet controller (for the e2e JobSet tests; built once from Go modules, then cached)"
bash "$ROOT/scripts/get-kube.sh" --jobset || echo "!! no JobSet controller: the e2e JobSet tests will be skipped" >&2
cd "$ROOT"
echo ">> ruff"; "$VENV/bin/ruff" check gpunode tests bench protos native
"$VENV/bin/ruff" format --check gpunode tests bench protos native
echo ">> mypy"; "$VENV/bin/mypy"
echo ">> import contracts"; "$VENV/bin/lint-imports" --no-cache | tail -n 8
echo ">> pytest"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
