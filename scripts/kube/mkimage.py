"""Pack a local test image as a one-layer `docker save` tarball, for `ctr images import`.

Usage: mkimage.py OUT.tar IMAGE_REF PAUSE_BINARY BUSYBOX_BINARY
       mkimage.py --files OUT.tar IMAGE_REF PATH_IN_IMAGE=HOST_FILE...

The first form is the local pause+busybox image: /pause (the sandbox process), /bin/busybox and a
/bin/<applet> link for every applet busybox lists. The second packs the host files named (their
contents, symlinks followed) at the paths given, with their parent directories: the e2e tests build
their capped-container image this way (a program, its shared libraries and the fake libcuda).
The tarball is byte-for-byte reproducible: fixed times, owners and ordering, so its digest only
changes when its inputs do.
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


def _files_entries(pairs: list[str]) -> list[tuple[str, bytes | None, str | None]]:
    files: dict[str, bytes] = {}
    for pair in pairs:
        inside, sep, host = pair.partition("=")
        if not sep or not inside.strip("/") or not host:
            sys.exit(f"mkimage.py: {pair!r} is not PATH_IN_IMAGE=HOST_FILE")
        with open(host, "rb") as f:
            files[inside.strip("/")] = f.read()
    dirs = {"/".join(name.split("/")[:i]) for name in files for i in range(1, name.count("/") + 1)}
    return [(d, None, None) for d in sorted(dirs)] + [(n, files[n], None) for n in sorted(files)]


def main() -> None:
    """Write the image tarball."""
    if sys.argv[1:2] == ["--files"]:
        out, ref, *pairs = sys.argv[2:]
        _write_image(out, ref, _files_entries(pairs), cmd=[])
        return
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
    _write_image(out, ref, entries, cmd=["/pause"])


def _write_image(
    out: str, ref: str, entries: list[tuple[str, bytes | None, str | None]], *, cmd: list[str]
) -> None:
    layer = _tar_bytes(entries)
    layer_id = hashlib.sha256(layer).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Env": ["PATH=/bin"], "Cmd": cmd, "WorkingDir": "/"},
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
