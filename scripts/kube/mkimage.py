"""Pack the local test image (a static pause plus busybox) as a `docker save` tarball.

Usage: mkimage.py OUT.tar IMAGE_REF PAUSE_BINARY BUSYBOX_BINARY

The image has /pause (the sandbox process), /bin/busybox and a /bin/<applet> link for every applet
busybox lists. `ctr images import` reads the result. The tarball is byte-for-byte reproducible: fixed
times, owners and ordering, so its digest only changes when its inputs do.
"""

import hashlib
import io
import json
import subprocess
import sys
import tarfile


def _add(tar: tarfile.TarFile, name: str, data: bytes | None = None, link: str | None = None) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    if link is not None:
        info.type = tarfile.SYMTYPE
        info.linkname = link
        tar.addfile(info)
    elif data is None:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
        tar.addfile(info)
    else:
        info.mode = 0o755 if data[:4] == b"\x7fELF" else 0o644
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def _tar_bytes(entries: list[tuple[str, bytes | None, str | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data, link in entries:
            _add(tar, name, data, link)
    return buf.getvalue()


def main() -> None:
    """Write the image tarball."""
    out, ref, pause_path, busybox_path = sys.argv[1:5]
    with open(pause_path, "rb") as f:
        pause = f.read()
    with open(busybox_path, "rb") as f:
        busybox = f.read()
    listed = subprocess.run([busybox_path, "--list"], check=True, capture_output=True, text=True).stdout
    applets = sorted({a for a in listed.split() if a and "/" not in a and a != "busybox"})
    entries: list[tuple[str, bytes | None, str | None]] = [
        ("bin", None, None),
        ("bin/busybox", busybox, None),
        *[(f"bin/{a}", None, "busybox") for a in applets],
        ("pause", pause, None),
        ("tmp", None, None),
    ]
    layer = _tar_bytes(entries)
    layer_id = hashlib.sha256(layer).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/pause"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_id}"]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "scripts/kube/mkimage.py"}],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [ref], "Layers": [f"{layer_id}/layer.tar"]}]
    name, tag = ref.rsplit(":", 1)
    image = _tar_bytes(
        [
            (f"{layer_id}", None, None),
            (f"{layer_id}/layer.tar", layer, None),
            (config_name, config_bytes, None),
            ("manifest.json", json.dumps(manifest, sort_keys=True).encode(), None),
            ("repositories", json.dumps({name: {tag: layer_id}}, sort_keys=True).encode(), None),
        ]
    )
    with open(out, "wb") as f:
        f.write(image)


if __name__ == "__main__":
    main()
