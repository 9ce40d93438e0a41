"""Objects decoded from the API server by many threads at once, each type for the first time.

msgspec builds a struct type's decoding tables on first use without a lock; two threads doing that
for the same type crashed the process with SIGSEGV (the agent's watches, publishers and plugin
threads all decode). Each run needs a fresh interpreter, where no type has been decoded yet.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from gpunode.errors import KubeError
from gpunode.infra.kube.transport import decode

_RACE = textwrap.dedent(
    """
    import threading
    from lightkube.resources.core_v1 import Node, Pod
    from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice
    from gpunode.infra.kube.transport import decode

    kinds = [ResourceClaim, Pod, Node, ResourceSlice]
    raw = b'{"metadata": {"name": "x", "labels": {"a": "b"}}, "spec": {}}'
    start = threading.Barrier(16)

    def first_decode(kind):
        start.wait()
        assert decode(raw, kind, "race").metadata.name == "x"

    threads = [threading.Thread(target=first_decode, args=(kinds[i % 4],)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("decoded")
    """
)


@pytest.mark.parametrize("run", range(5))
def test_sixteen_threads_decoding_new_types_at_once_do_not_crash(run: int) -> None:
    done = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.strip() == "decoded"


def test_an_answer_that_does_not_fit_is_one_kube_error() -> None:
    from lightkube.resources.core_v1 import Pod

    with pytest.raises(KubeError, match="not a valid Pod"):
        decode(b'{"metadata": 7}', Pod, "read pod")
