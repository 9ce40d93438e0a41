"""The queue configuration's `namespaces:` key: the leaf queue each namespace's unlabelled pods wait in.

    namespaces:
      team-a-ns: team-a

A namespace must be a Kubernetes namespace name (a DNS-1123 label) and its queue a leaf
of the queue tree; each mistake is one QueueConfigError naming the key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpunode.contract.reader import SectionReader, excerpt

NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS-1123 label


def read_namespaces(top: SectionReader, children: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """Validate `namespaces:` of the document `top` reads; `children`: every queue -> its children."""
    data = top.raw("namespaces", {})
    r = top.item(data, top.key_path("namespaces"))
    leaves = ", ".join(n for n, kids in children.items() if not kids)
    out: dict[str, str] = {}
    for key in list(data):
        ns = key if isinstance(key, str) else ""
        if not NAMESPACE.fullmatch(ns):
            raise r.fail(
                str(key),
                f"{excerpt(key)} is not a valid namespace name",
                hint="a namespace name is 1 to 63 lowercase letters, digits or '-', starting and ending "
                "with a letter or digit",
            )
        queue = r.get(ns, str)
        if queue not in children:
            raise r.fail(
                ns, f"no queue is named {excerpt(queue)}", hint=f"name one of the leaf queues: {leaves}"
            )
        if children[queue]:
            raise r.fail(
                ns,
                f"{queue} is not a leaf queue (it has children: {', '.join(children[queue])})",
                hint=f"jobs wait in leaf queues: name one of {leaves}",
            )
        out[ns] = queue
    r.finish()
    return out
