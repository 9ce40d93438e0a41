#!/usr/bin/env bash
# The main job: run the gpunode agent. Without a GPU it runs on the bundled simulated node
# (dgx-h100 by default; GPUNODE_SIM_PROFILE=t4|a100-mig|h100-mig or a YAML file), with the
# device-plugin sockets in ./run/device-plugins, metrics on :9400 and a fault-injection socket.
# Extra arguments go to `gpunode agent` (e.g. --config gpunode/examples/config-timeslicing.yaml).
# The agent runs in the foreground (Ctrl-C stops it). apt waits for another apt holding the dpkg lock, and
# gpunode is reinstalled only when its packaging or native sources changed (see common.sh).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ensure_apt_packages gcc libc6-dev pkg-config libsystemd-dev
ensure_venv "[systemd]"
RUN="${GPUNODE_RUN_DIR:-$ROOT/run}"
mkdir -p "$RUN/device-plugins" "$RUN/state"
BACKEND="${GPUNODE_BACKEND:-auto}"
if [ "$BACKEND" = auto ] && ! "$VENV/bin/python" -c 'import pynvml; pynvml.nvmlInit(); assert pynvml.nvmlDeviceGetCount() > 0' 2>/dev/null; then
  echo ">> no NVIDIA GPU here: running on the simulated node '${GPUNODE_SIM_PROFILE:-dgx-h100}'"
  BACKEND=sim
fi
echo ">> starting gpunode agent in the foreground (Ctrl-C stops it); use a second terminal for other commands"
exec "$VENV/bin/gpunode" agent --backend "$BACKEND" --sim-profile "${GPUNODE_SIM_PROFILE:-dgx-h100}" \
  --kubelet-dir "$RUN/device-plugins" --state-dir "$RUN/state" \
  --sim-control-socket "$RUN/sim.sock" "$@"
