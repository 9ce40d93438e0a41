"""Registration with the kubelet's plugin watcher: the `<driver>-reg.sock` socket in plugins_registry/.

The kubelet finds the socket (inotify on its plugins_registry directory, and a scan of it when it
starts, so a restarted kubelet finds a running plugin again by itself), calls GetInfo and learns
the driver's name, the DRA service's socket and the gRPC services served (`v1.DRAPlugin`,
`v1beta1.DRAPlugin`, and the health stream as `v1.DRAResourceHealth` and `v1alpha1.DRAResourceHealth`:
kubelet 1.37 opens the health stream only for a plugin that lists it, 1.36 asks v1alpha1 regardless);
it then says with NotifyRegistrationStatus whether it took the plugin.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from gpunode.node.kubelet._proto import pluginregistration_v1_pb2 as pb
from gpunode.node.kubelet._proto import pluginregistration_v1_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SERVICE_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")


class RegistrationServicer(pb_grpc.RegistrationServicer):
    """Answers the kubelet's plugin watcher for one driver."""

    def __init__(self, driver: str, endpoint: Path) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.registered: bool | None = None  # the kubelet's last word; None before it spoke
        self.error = ""
        self.infos = 0  # GetInfo calls answered (a restarted kubelet asks again)

    async def GetInfo(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.PluginInfo:
        """The driver's name, its DRA socket and the service versions it serves."""
        self.infos += 1
        return pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver,
            endpoint=str(self.endpoint),
            supported_versions=list(SERVICE_VERSIONS),
        )

    async def NotifyRegistrationStatus(
        self, request: pb.RegistrationStatus, context: grpc.aio.ServicerContext
    ) -> pb.RegistrationStatusResponse:
        """Log what the kubelet decided (a refusal is an error: no claim of the driver can start here)."""
        self.registered, self.error = request.plugin_registered, request.error
        if request.plugin_registered:
            log.info("DRA: the kubelet registered driver %s (%s)", self.driver, self.endpoint)
        else:
            log.error(
                "DRA: the kubelet refused driver %s: %s", self.driver, " ".join(request.error.split())[:300]
            )
        return pb.RegistrationStatusResponse()
