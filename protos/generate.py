"""Generate the Python gRPC stubs in gpunode/node/kubelet/_proto/ from the .proto files in protos/.

    python protos/generate.py [--out DIR]

Uses grpcio-tools (the protoc bundled with it), so the output depends only on
the .proto files and the grpcio-tools version. The generated modules import
each other as `gpunode.node.kubelet._proto.<name>_pb2`; the imports protoc writes are
rewritten to that package-relative form. tests/node/test_proto_stubs.py regenerates
into a temporary directory and checks the committed stubs match.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = PROTO_DIR.parent / "gpunode" / "node" / "kubelet" / "_proto"
PROTOS = (
    "deviceplugin_v1beta1.proto",
    "podresources_v1.proto",
    "dra_v1.proto",
    "dra_v1beta1.proto",
    "drahealth_v1alpha1.proto",
    "pluginregistration_v1.proto",
)


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # test/dev dependency only

    out.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_DIR}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(PROTO_DIR / proto),
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto} (exit {rc})")
    written = sorted(p for p in out.iterdir() if p.suffix in {".py", ".pyi"} and p.name != "__init__.py")
    for path in written:
        text = path.read_text()
        text = re.sub(
            r"^import (\w+_pb2) as", r"from gpunode.node.kubelet._proto import \1 as", text, flags=re.M
        )
        path.write_text(text)
    init = out / "__init__.py"
    init.write_text(
        '"""Generated gRPC stubs for the kubelet APIs (see protos/generate.py). Do not edit."""\n'
    )
    return [init, *written]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
