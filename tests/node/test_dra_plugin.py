"""The DRA kubelet plugin over its real Unix sockets, with a gRPC stand-in for the kubelet and an API
server stand-in holding the ResourceClaims and the node's ResourceSlice (tests/node/dra_world.py)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpunode.node import memcap
from gpunode.node.kubelet._proto import drahealth_v1alpha1_pb2 as hpb
from gpunode.node.kubelet._proto import pluginregistration_v1_pb2 as rpb
from tests.node.dra_world import DRIVER, GIB, GPUS, NODE, World, claim, new_uid, v1, v1beta1, world

ROOT = Path(__file__).resolve().parents[2]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def spec_files(w: World) -> list[str]:
    return sorted(p.name for p in w.cdi_dir.iterdir()) if w.cdi_dir.exists() else []


def region_dirs(w: World) -> list[str]:
    return (
        sorted(p.name for p in w.regions.iterdir() if not p.name.startswith("."))
        if w.regions.exists()
        else []
    )


def records(w: World) -> list[str]:
    d = w.config.state_dir / "dra" / "claims"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# --- registration and sockets ---------------------------------------------------------------------


def test_registration_names_the_driver_its_socket_and_both_versions() -> None:
    async def scenario() -> None:
        async with world() as w:
            info = await w.registration.GetInfo(rpb.InfoRequest(), timeout=5)
            assert info.type == "DRAPlugin"
            assert info.name == DRIVER
            assert info.endpoint == str(w.config.dra.service_socket(w.config.kubelet_dir))
            assert info.endpoint.endswith(f"/plugins/{DRIVER}/dra.sock")
            assert list(info.supported_versions) == [
                "v1.DRAPlugin",
                "v1beta1.DRAPlugin",
                "v1.DRAResourceHealth",
                "v1alpha1.DRAResourceHealth",
            ]
            reg_path = w.plugin.registrar.path
            assert reg_path == w.root / "kubelet" / "plugins_registry" / f"{DRIVER}-reg.sock"
            for path in (reg_path, w.plugin.service.path):
                st = os.stat(path)
                assert stat.S_ISSOCK(st.st_mode)
                assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
                assert st.st_uid == os.getuid()
            await w.registration.NotifyRegistrationStatus(
                rpb.RegistrationStatus(plugin_registered=True), timeout=5
            )
            assert w.plugin.registration.registered is True
            await w.registration.NotifyRegistrationStatus(
                rpb.RegistrationStatus(plugin_registered=False, error="version mismatch"), timeout=5
            )
            assert w.plugin.registration.registered is False

    run(scenario())


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_user_of_the_node_cannot_connect_to_either_socket() -> None:
    async def scenario() -> None:
        async with world() as w:
            os.chmod(w.root, 0o755)  # even with every directory on the way open to it
            for d in (
                w.plugin.service.path.parent,
                w.plugin.registrar.path.parent,
                w.root / "kubelet",
                w.root / "kubelet" / "plugins",
            ):
                os.chmod(d, 0o755)
            for path in (w.plugin.service.path, w.plugin.registrar.path):
                probe = (
                    "import os, socket, sys\n"
                    "os.setgid(65534); os.setuid(65534)\n"
                    "s = socket.socket(socket.AF_UNIX)\n"
                    "try:\n"
                    "    s.connect(sys.argv[1])\n"
                    "except PermissionError:\n"
                    "    sys.exit(13)\n"
                    "sys.exit(0)\n"
                )
                proc = await asyncio.create_subprocess_exec(sys.executable, "-c", probe, str(path))
                assert await proc.wait() == 13, f"user nobody could connect to {path}"

    run(scenario())


def test_a_removed_socket_is_served_again_so_the_kubelet_registers_the_driver_anew() -> None:
    async def scenario() -> None:
        async with world() as w:
            os.unlink(w.plugin.registrar.path)
            os.unlink(w.plugin.service.path)
            for _ in range(100):
                if w.plugin.restarts >= 2:
                    break
                await asyncio.sleep(0.05)
            assert w.plugin.restarts == 2
            async with grpc.aio.insecure_channel(f"unix://{w.plugin.registrar.path}") as ch:
                from gpunode.node.kubelet._proto import pluginregistration_v1_pb2_grpc as reg_grpc

                info = await reg_grpc.RegistrationStub(ch).GetInfo(rpb.InfoRequest(), timeout=5)
            assert info.name == DRIVER
            assert stat.S_IMODE(os.stat(w.plugin.service.path).st_mode) == 0o600
            async with grpc.aio.insecure_channel(f"unix://{w.plugin.service.path}") as ch:
                from gpunode.node.kubelet._proto import dra_v1_pb2_grpc

                c = w.api.add(claim("after-restart"))
                resp = await dra_v1_pb2_grpc.DRAPluginStub(ch).NodePrepareResources(
                    v1.NodePrepareResourcesRequest(
                        claims=[v1.Claim(namespace=c.namespace, uid=c.uid, name=c.name)]
                    ),
                    timeout=10,
                )
            assert resp.claims[c.uid].error == ""

    run(scenario())


# --- prepare and unprepare --------------------------------------------------------------------


def test_a_shared_gpu_claim_gets_a_fresh_capped_region_and_a_cdi_spec() -> None:
    async def scenario() -> None:
        async with world() as w:
            c = w.api.add(claim("train", memory="4Gi", share="7f1e"))
            resp = await w.prepare(c)
            answer = resp.claims[c.uid]
            assert answer.error == ""
            [dev] = answer.devices
            assert list(dev.request_names) == ["gpu"]
            assert (dev.pool_name, dev.device_name, dev.share_id) == (NODE, "gpu-0-shared", "7f1e")
            assert list(dev.cdi_device_ids) == [f"{DRIVER}/claim={c.uid}-0"]
            # the spec: named from the UID only, 0644, the interposer and the region at the fixed path
            path = w.cdi_dir / f"{DRIVER}-{c.uid}.json"
            assert spec_files(w) == [path.name]
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
            spec = json.loads(path.read_text())
            assert spec["kind"] == f"{DRIVER}/claim"
            assert [d["name"] for d in spec["devices"]] == [f"{c.uid}-0"]
            # CDI refuses a device without edits: each carries the GPU it sees
            assert spec["devices"][0]["containerEdits"] == {"env": [f"NVIDIA_VISIBLE_DEVICES={GPUS[0].uuid}"]}
            env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
            assert env["NVIDIA_VISIBLE_DEVICES"] == GPUS[0].uuid
            assert env["LD_PRELOAD"] == f"{memcap.CONTAINER_DIR}/lib/{memcap.LIBRARY_NAME}"
            assert env[memcap.ENV_LIMIT_INFO] == str(4 * GIB)
            mounts = {m["containerPath"]: m for m in spec["containerEdits"]["mounts"]}
            limit = mounts[f"{memcap.CONTAINER_DIR}/memcap/{memcap.LIMIT_FILE}"]
            assert "ro" in limit["options"]
            assert "rw" in mounts[f"{memcap.CONTAINER_DIR}/memcap/{memcap.USAGE_FILE}"]["options"]
            assert "ro" in mounts[env["LD_PRELOAD"]]["options"]
            # the region: capped at the memory the claim consumed, of that GPU
            [key] = region_dirs(w)
            region = memcap.load_region(w.regions / key)
            assert limit["hostPath"] == str(region.limit_path)
            assert (region.gpu_uuid, region.limit_bytes, region.device_total_bytes) == (
                GPUS[0].uuid,
                4 * GIB,
                80 * GIB,
            )
            # unprepare takes everything away, and again is no error
            for _ in range(2):
                out = await w.unprepare(c)
                assert out.claims[c.uid].error == ""
                assert spec_files(w) == [] and region_dirs(w) == [] and records(w) == []

    run(scenario())


def test_v1beta1_serves_the_same_logic() -> None:
    async def scenario() -> None:
        async with world() as w:
            c = w.api.add(claim("beta", memory="6Gi"))
            resp = await w.prepare(c, version=v1beta1)
            [dev] = resp.claims[c.uid].devices
            assert list(dev.cdi_device_ids) == [f"{DRIVER}/claim={c.uid}-0"]
            assert memcap.load_region(w.regions / region_dirs(w)[0]).limit_bytes == 6 * GIB
            # prepared through v1beta1, answered the same through v1 (the kubelet may switch)
            again = await w.prepare(c, version=v1)
            assert list(again.claims[c.uid].devices[0].cdi_device_ids) == list(dev.cdi_device_ids)
            assert (await w.unprepare(c, version=v1beta1)).claims[c.uid].error == ""
            assert spec_files(w) == [] and region_dirs(w) == []

    run(scenario())


def test_a_whole_gpu_claim_is_not_capped() -> None:
    async def scenario() -> None:
        async with world() as w:
            c = w.api.add(claim("whole", device="gpu-1", memory=None, share=None))
            resp = await w.prepare(c)
            assert resp.claims[c.uid].error == ""
            assert not resp.claims[c.uid].devices[0].HasField("share_id")
            spec = json.loads((w.cdi_dir / f"{DRIVER}-{c.uid}.json").read_text())
            env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
            assert env == {"NVIDIA_VISIBLE_DEVICES": GPUS[1].uuid}
            assert "mounts" not in spec["containerEdits"]
            assert region_dirs(w) == []

    run(scenario())


def test_a_claim_prepared_twice_is_prepared_once() -> None:
    async def scenario() -> None:
        async with world() as w:
            c = w.api.add(claim("twice"))
            first = await w.prepare(c)
            region = memcap.load_region(w.regions / region_dirs(w)[0])
            spec = (w.cdi_dir / f"{DRIVER}-{c.uid}.json").stat()
            reads = len(w.api.requests)
            # twice in a row, and twice at once
            second = await w.prepare(c)
            third, fourth = await asyncio.gather(w.prepare(c), w.prepare(c))
            for resp in (second, third, fourth):
                assert resp == first
            assert memcap.load_region(w.regions / region_dirs(w)[0]).generation == region.generation
            assert (w.cdi_dir / f"{DRIVER}-{c.uid}.json").stat().st_ino == spec.st_ino
            assert len(w.api.requests) == reads  # answered from the record, the claim not read again
            assert len(region_dirs(w)) == 1 and len(spec_files(w)) == 1

    run(scenario())


def test_each_claim_gets_its_own_error_and_the_others_are_prepared() -> None:
    async def scenario() -> None:
        async with world() as w:
            good = w.api.add(claim("good", memory="4Gi"))
            too_big = w.api.add(claim("too-big", memory="100Gi"))
            bad_config = w.api.add(
                claim(
                    "bad-config",
                    parameters={"apiVersion": "gpunode.io/v1alpha1", "kind": "GpuConfig", "cap": 1},
                )
            )
            wrong_kind = w.api.add(claim("wrong-kind", parameters={"apiVersion": "v1", "kind": "ConfigMap"}))
            mig = w.api.add(claim("mig", device="gpu-0-mig-1g", memory=None))
            missing = claim("missing")  # never stored at the API server
            from tests.node.dra_world import ref

            gone = ref(missing)
            recreated = w.api.add(claim("recreated"))
            stale = type(recreated)(recreated.namespace, new_uid(), recreated.name)  # the kubelet's older UID
            unallocated_obj = claim("unallocated")
            unallocated_obj["status"] = {}
            unallocated = w.api.add(unallocated_obj)
            resp = await w.prepare(good, too_big, bad_config, wrong_kind, mig, gone, stale, unallocated)
            errors = {uid: resp.claims[uid].error for uid in resp.claims}
            assert errors[good.uid] == ""
            assert "100Gi of GPU memory asked of node-a/gpu-0-shared, which has 80Gi" in errors[too_big.uid]
            assert "opaque.parameters.cap: unknown field" in errors[bad_config.uid]
            assert "expected apiVersion gpunode.io/v1alpha1 and kind GpuConfig" in errors[wrong_kind.uid]
            assert "MIG placement" in errors[mig.uid]
            assert "the ResourceClaim does not exist" in errors[gone.uid]
            assert "deleted and created again" in errors[stale.uid]
            assert "it is not allocated" in errors[unallocated.uid]
            for uid, error in errors.items():
                assert "\n" not in error
                if uid != good.uid:
                    assert error.startswith("claim team-a/"), error
            assert spec_files(w) == [f"{DRIVER}-{good.uid}.json"]
            assert len(region_dirs(w)) == 1 and records(w) == [f"{good.uid}.json"]

    run(scenario())


def test_a_valid_opaque_config_sets_fail_open() -> None:
    async def scenario() -> None:
        async with world() as w:
            c = w.api.add(
                claim(
                    "open",
                    parameters={"apiVersion": "gpunode.io/v1alpha1", "kind": "GpuConfig", "failOpen": True},
                )
            )
            assert (await w.prepare(c)).claims[c.uid].error == ""
            assert memcap.load_region(w.regions / region_dirs(w)[0]).fail_open is True

    run(scenario())


# --- attacks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uid",
    [
        "../../../tmp/evil",
        "..",
        "a/b",
        "0" * 36,
        "x" * 5000,
        "12345678-1234-1234-1234-123456789abc\0.json",
        "",
    ],
)
def test_a_claim_uid_crafted_to_escape_the_cdi_directory_names_no_file(uid: str) -> None:
    async def scenario() -> None:
        async with world() as w:
            c = w.api.add(claim("escape", uid=uid))
            resp = await w.prepare(c)
            assert "is not a Kubernetes UID" in resp.claims[uid].error
            assert spec_files(w) == [] and region_dirs(w) == [] and records(w) == []
            assert "is not a Kubernetes UID" in (await w.unprepare(c)).claims[uid].error
            assert not (w.root / "tmp").exists() and not Path("/tmp/evil.json").exists()

    run(scenario())


def test_a_claim_name_with_path_parts_does_not_reach_a_path() -> None:
    async def scenario() -> None:
        async with world() as w:
            c = w.api.add(claim("../../etc/cron.d/x", namespace="../.."))
            resp = await w.prepare(c)
            assert resp.claims[c.uid].error == ""
            assert spec_files(w) == [f"{DRIVER}-{c.uid}.json"]  # named from the UID alone

    run(scenario())


@pytest.mark.parametrize(
    ("parameters", "words"),
    [
        ("a string", "expected a GpuConfig object, got str"),
        ([1, 2], "expected a GpuConfig object, got list"),
        (
            {"apiVersion": "gpunode.io/v1alpha1", "kind": "GpuConfig", "failOpen": "yes"},
            "failOpen: expected true",
        ),
        ({"apiVersion": "gpunode.io/v1alpha1", "kind": "GpuConfig", "x" * 100: 1}, "unknown field"),
        (
            {"apiVersion": "gpunode.io/v1alpha1", "kind": "GpuConfig", "pad": "y" * 20000},
            "larger than 10 KiB",
        ),
    ],
)
def test_a_hostile_opaque_config_is_refused_for_its_claim(parameters: Any, words: str) -> None:
    async def scenario() -> None:
        async with world() as w:
            c = w.api.add(claim("hostile", parameters=parameters))
            error = (await w.prepare(c)).claims[c.uid].error
            assert words in error and len(error) < 600
            assert spec_files(w) == [] and region_dirs(w) == []

    run(scenario())


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"pool": "node-b"}, "is not one of this node's gpu.gpunode.io devices"),
        ({"device": "gpu-9"}, "is not one of this node's"),
        ({"memory": "-4Gi"}, "cannot be negative"),
        ({"memory": "1e99"}, "has an exponent beyond"),
        ({"memory": "4Gi" + "0" * 100}, "is not plausible"),
        ({"memory": None}, "has no consumedCapacity.memory"),
    ],
)
def test_an_allocation_for_another_node_or_beyond_bounds_is_refused(
    changes: dict[str, Any], words: str
) -> None:
    async def scenario() -> None:
        async with world() as w:
            c = w.api.add(claim("odd", **changes))
            assert words in (await w.prepare(c)).claims[c.uid].error
            assert spec_files(w) == [] and region_dirs(w) == []

    run(scenario())


def test_a_gpu_served_by_the_device_plugin_is_not_prepared_through_dra() -> None:
    async def scenario() -> None:
        async with world(devices=[1, 2]) as w:  # GPU 0 stays with the device plugin
            c = w.api.add(claim("plugin-gpu", device="gpu-0-shared"))
            assert "is not served through DRA on this node" in (await w.prepare(c)).claims[c.uid].error
            ok = w.api.add(claim("dra-gpu", device="gpu-1-shared"))
            assert (await w.prepare(ok)).claims[ok.uid].error == ""

    run(scenario())


def test_a_request_that_does_not_decode_is_invalid_argument() -> None:
    async def scenario() -> None:
        async with world() as w:
            call = w.channel.unary_unary("/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(b"\x0a\xff\xff\xff\xff\x0f", timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(scenario())


def test_a_cdi_directory_that_cannot_be_written_refuses_the_claim_and_leaves_nothing(tmp_path: Path) -> None:
    from tests.fakes.kubelet import short_socket_dir

    root = short_socket_dir()
    (root / "cdi").write_text("a file where the directory should be")

    async def scenario() -> None:
        async with world(root) as w:
            c = w.api.add(claim("nowhere"))
            error = (await w.prepare(c)).claims[c.uid].error
            assert "cannot prepare it on this node" in error and str(w.cdi_dir) in error
            assert region_dirs(w) == [] and records(w) == []

    run(scenario())


# --- crash and restart -----------------------------------------------------------------------------

_KILLED = """
import asyncio, os, sys
from tests.node.dra_world import world, claim
from gpunode.node.dra import cdi
root = sys.argv[1]
def die(*a, **k):
    os._exit(137)  # the agent is killed after its record and region, before the CDI spec
cdi.write_spec = die
async def main():
    from pathlib import Path
    async with world(Path(root)) as w:
        c = w.api.add(claim("killed", uid=sys.argv[2]))
        await w.prepare(c)
asyncio.run(main())
"""


def test_an_agent_killed_mid_prepare_neither_leaks_nor_prepares_twice(tmp_path: Path) -> None:
    from tests.fakes.kubelet import short_socket_dir

    root = short_socket_dir()
    uid = new_uid()
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED, str(root), uid], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 137, proc.stderr[-2000:]
    state = root / "state" / "dra"
    record = json.loads((state / "claims" / f"{uid}.json").read_text())
    assert record["state"] == "preparing"
    assert (state / "memcap" / f"claim-{uid}").is_dir()  # made, never handed out
    assert not (root / "cdi" / f"{DRIVER}-{uid}.json").exists()

    async def scenario() -> None:
        async with world(root) as w:  # the restarted agent rolls the claim back before serving
            assert region_dirs(w) == [] and records(w) == [] and spec_files(w) == []
            c = w.api.add(claim("killed", uid=uid))
            resp = await w.prepare(c)  # the kubelet's retry prepares it, once
            assert resp.claims[uid].error == ""
            assert region_dirs(w) == [f"claim-{uid}"] and spec_files(w) == [f"{DRIVER}-{uid}.json"]

    run(scenario())


def test_a_kubelet_that_gives_up_mid_prepare_gets_the_claim_prepared_once_on_its_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kubelet's call ends (its deadline, or the kubelet restarted) while the claim is read or while
    its region and spec are made: the retry finds nothing half-made and nothing made twice."""
    from gpunode.node.dra import prepare as prepare_module

    real_replace = memcap.replace_region

    made: list[str] = []

    def slow_replace(*args: Any, **kwargs: Any) -> Any:
        made.append(args[1])
        time.sleep(0.6)
        return real_replace(*args, **kwargs)

    async def scenario() -> None:
        async with world() as w:
            # 1. gone while the claim is read from the API server: nothing is made
            c = w.api.add(claim("slow-read"))
            w.api.claim_delay_s = 0.6
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await w.stub_v1.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(
                        claims=[v1.Claim(namespace=c.namespace, uid=c.uid, name=c.name)]
                    ),
                    timeout=0.2,
                )
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.8)
            w.api.claim_delay_s = 0.0
            first = await w.prepare(c)
            assert first.claims[c.uid].error == "" and len(region_dirs(w)) == 1
            # 2. gone while the region is made: the work finishes, the retry is answered from the record
            d = w.api.add(claim("slow-make"))
            monkeypatch.setattr(prepare_module.memcap, "replace_region", slow_replace)
            with pytest.raises(grpc.aio.AioRpcError):
                await w.stub_v1.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(
                        claims=[v1.Claim(namespace=d.namespace, uid=d.uid, name=d.name)]
                    ),
                    timeout=0.2,
                )
            # the retry comes at once: it waits for the work in flight and is answered from its record
            again = await w.prepare(d)
            assert again.claims[d.uid].error == ""
            region = memcap.load_region(w.regions / f"claim-{d.uid}")
            assert await w.prepare(d) == again
            assert memcap.load_region(w.regions / f"claim-{d.uid}").generation == region.generation
            assert made == [f"claim-{d.uid}"]  # one region made for it, not two
            assert sorted(region_dirs(w)) == sorted([f"claim-{c.uid}", f"claim-{d.uid}"])
            assert len(spec_files(w)) == 2 and len(records(w)) == 2

    run(scenario())


def test_claims_gone_from_the_api_server_are_unprepared_by_the_agent_itself() -> None:
    """A kubelet that lost its record of a claim never unprepares it: the agent removes a prepared claim
    whose ResourceClaim is gone (or made again under a new UID), and nothing while it cannot ask."""

    async def scenario() -> None:
        async with world() as w:
            gone, kept, recreated = (w.api.add(claim(n)) for n in ("gone", "kept", "recreated"))
            for c in (gone, kept, recreated):
                assert (await w.prepare(c)).claims[c.uid].error == ""
            del w.api.claims[(gone.namespace, gone.name)]
            w.api.add(claim("recreated"))  # the same name, a new UID
            removed = await w.plugin.preparer.collect_orphans()
            assert sorted(removed) == sorted([gone.uid, recreated.uid])
            assert region_dirs(w) == [f"claim-{kept.uid}"] and spec_files(w) == [f"{DRIVER}-{kept.uid}.json"]
            w.api.close()  # the API server unreachable: nothing is removed
            assert await w.plugin.preparer.collect_orphans() == []
            assert region_dirs(w) == [f"claim-{kept.uid}"]

    run(scenario())


def test_prepared_claims_survive_an_agent_restart_and_are_unprepared_after_it() -> None:
    from tests.fakes.kubelet import short_socket_dir

    root = short_socket_dir()

    async def first() -> tuple[Any, Any]:
        async with world(root) as w:
            c = w.api.add(claim("kept"))
            return c, await w.prepare(c)

    c, before = run(first())

    async def second() -> None:
        async with world(root) as w:
            w.api.add(claim("kept", uid=c.uid))
            assert region_dirs(w) == [f"claim-{c.uid}"]
            region = memcap.load_region(w.regions / f"claim-{c.uid}")
            assert await w.prepare(c) == before  # the kubelet asks again after its own restart
            assert memcap.load_region(w.regions / f"claim-{c.uid}").generation == region.generation
            assert (await w.unprepare(c)).claims[c.uid].error == ""
            assert region_dirs(w) == [] and spec_files(w) == [] and records(w) == []

    run(second())


def test_a_prepared_claim_whose_spec_was_removed_is_prepared_afresh() -> None:
    async def scenario() -> None:
        async with world() as w:
            c = w.api.add(claim("damaged"))
            first = await w.prepare(c)
            (w.cdi_dir / f"{DRIVER}-{c.uid}.json").unlink()
            assert await w.prepare(c) == first
            assert spec_files(w) == [f"{DRIVER}-{c.uid}.json"] and len(region_dirs(w)) == 1

    run(scenario())


# --- health --------------------------------------------------------------------------------------


def test_the_health_stream_follows_the_health_engine() -> None:
    async def scenario() -> None:
        async with world() as w:
            stream = w.health.NodeWatchResources(hpb.NodeWatchResourcesRequest(), timeout=10)
            first = await stream.read()
            names = {(d.device.pool_name, d.device.device_name): d for d in first.devices}
            assert (NODE, "gpu-0-shared") in names and (NODE, "gpu-2") in names
            assert {d.health for d in first.devices} == {hpb.HEALTHY}
            w.state.set_unhealthy("health", {GPUS[1].uuid: "XID 79: GPU fell off the bus"})
            second = await stream.read()
            sick = {d.device.device_name: d for d in second.devices if d.health == hpb.UNHEALTHY}
            assert set(sick) == {"gpu-1", "gpu-1-shared"}
            assert sick["gpu-1"].message == "XID 79: GPU fell off the bus"
            assert sick["gpu-1"].health_check_timeout_seconds > 0
            stream.cancel()
            # The same stream as DRAResourceHealth v1, the service kubelet 1.37+ asks for first.
            v1_watch = w.channel.unary_stream(
                "/v1.DRAResourceHealth/NodeWatchResources",
                request_serializer=hpb.NodeWatchResourcesRequest.SerializeToString,
                response_deserializer=hpb.NodeWatchResourcesResponse.FromString,
            )
            v1_stream = v1_watch(hpb.NodeWatchResourcesRequest(), timeout=10)
            sick_v1 = {
                d.device.device_name for d in (await v1_stream.read()).devices if d.health == hpb.UNHEALTHY
            }
            assert sick_v1 == {"gpu-1", "gpu-1-shared"}
            v1_stream.cancel()

    run(scenario())
