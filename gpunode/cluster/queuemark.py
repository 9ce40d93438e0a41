"""Signed queue admission marks: the one place both the queue controller and the extender sign and check them.

The controller admits a queued pod by writing gpunode.io/queue-admitted (JSON {"job", "uid", "node", "gpus",
"at"}); the extender lets the pod through only with such a mark. The UID binding stops a mark put on a pod
when it is created, but the pod's owner may patch its pods (the `edit` ClusterRole allows it), read the UID
and write a mark afterwards. With a shared secret key (--admission-key-file on `gpunode queue` and
`gpunode extender`) the controller adds "sig": HMAC-SHA256 over the canonical JSON of the five fields
(sorted keys, no spaces, ASCII) after a domain prefix, base64url without padding. Only the holders of the
key can write a mark that verifies, and the UID inside the signed text keeps a valid mark from being
copied onto another pod.

A signed mark also carries "gen", its generation (nanoseconds since the epoch when the controller wrote
it, and above any generation it wrote for that pod before; signed with the rest): the pod's owner can read
a mark and put it back after the controller replaced it (re-planned the pod onto another node), and that
old mark still verifies. Each MarkKey remembers the newest generation it has seen verify for each pod UID
(the last NEWEST_PODS pods) and refuses an older one: the controller from the marks it writes, the extender
from the marks it reads at filter and bind. A mark without "gen" (written before generations) counts as
generation 0. What a process has not seen it cannot refuse: an extender that never read the newer mark
(the owner put the old one back before kube-scheduler sent the pod again, or a new extender leader)
takes the old one, until the controller's next reconcile finds the pod marked against its plan.

The key file holds at least MIN_KEY_BYTES bytes (a trailing newline is not part of the key); its mode is
not checked, as a Kubernetes Secret is mounted readable by the group and others by default.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpunode.config.files import read_regular
from gpunode.errors import AdmissionKeyError

log = logging.getLogger(__name__)

DOMAIN = b"gpunode.io/queue-admitted/v1\n"
FIELDS = ("job", "uid", "node", "gpus", "at")
MIN_KEY_BYTES = 32
MAX_KEY_FILE_BYTES = 4096  # a key file larger than this is the wrong file
SIG_CHARS = 43  # base64url of 32 bytes without padding
REPORTED_PODS = 4096  # pods whose refused mark was logged, remembered so that each is logged once
CACHED_MARKS = 32768  # mark texts whose check is remembered (every pod's mark is read at every reconcile)
CACHED_TEXT = 2048  # characters: longer mark texts are checked each time, not remembered
NEWEST_PODS = 65536  # pod UIDs whose newest mark generation is remembered
MAX_GENERATION = 2**63 - 1
UNSIGNED_WARNING = (
    "queue admissions are NOT signed (no --admission-key-file): any tenant able to patch its own pods can "
    "write an admission mark and skip the queue; give the controller and the extender the same key file"
)


def canonical(fields: Mapping[str, Any]) -> bytes:
    """The bytes a mark's signature covers: the domain, then the JSON of its FIELDS (absent ones as null)."""
    doc = {k: fields.get(k) for k in FIELDS}
    if fields.get("gen") is not None:  # marks written before generations are signed without it
        doc["gen"] = fields["gen"]
    return DOMAIN + json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


class MarkKey:
    """The shared secret that signs and checks admission marks. Its repr does not show the secret."""

    def __init__(self, secret: bytes, *, source: str = "") -> None:
        if len(secret) < MIN_KEY_BYTES:
            raise AdmissionKeyError(
                f"the admission key{f' in {source}' if source else ''} has {len(secret)} bytes, fewer than "
                f"{MIN_KEY_BYTES}"
            )
        self._secret = secret
        self.source = source
        self._reported: OrderedDict[str, None] = OrderedDict()
        self._checked: dict[str, bool] = {}  # mark text -> whether its signature verifies
        self._newest: OrderedDict[str, int] = OrderedDict()  # pod UID -> newest generation seen
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MarkKey(source={self.source!r})"

    def sign(self, fields: Mapping[str, Any]) -> str:
        """The "sig" of a mark with these fields."""
        digest = hmac.new(self._secret, canonical(fields), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

    def verify(self, mark: Mapping[str, Any]) -> bool:
        """Whether the mark's "sig" is this key's signature of its fields (False when absent or malformed)."""
        sig = mark.get("sig")
        if not isinstance(sig, str) or len(sig) != SIG_CHARS or not sig.isascii():
            return False
        return hmac.compare_digest(sig, self.sign(mark))

    def verify_text(self, text: str, mark: Mapping[str, Any]) -> bool:
        """verify(mark), `mark` being the JSON `text` parsed, remembered by text: the controller reads every
        pod's mark at every reconcile (about 7 us a check; the text names the UID, so a result holds for
        whichever pod carries it). At most CACHED_MARKS texts are kept, then the memory starts afresh."""
        if len(text) > CACHED_TEXT:
            return self.verify(mark)
        known = self._checked.get(text)
        if known is None:
            known = self.verify(mark)
            if len(self._checked) >= CACHED_MARKS:
                self._checked.clear()
            self._checked[text] = known
        return known

    def next_generation(self, uid: str) -> int:
        """The generation of a mark about to be written for the pod: now in nanoseconds, and above any
        generation seen for it (a clock that stepped back does not make a new mark older); remembered."""
        with self._lock:
            gen = max(time.time_ns(), self._newest.get(uid, -1) + 1)
            self._remember(uid, gen)
            return gen

    def accept_generation(self, uid: str, gen: int) -> bool:
        """False when a newer mark of the pod has been seen (this one was replaced); else remember `gen`."""
        with self._lock:
            newest = self._newest.get(uid)
            if newest is not None and gen < newest:
                return False
            self._remember(uid, gen)
            return True

    def newest(self, uid: str) -> int | None:
        """The newest generation seen for the pod, if any."""
        with self._lock:
            return self._newest.get(uid)

    def _remember(self, uid: str, gen: int) -> None:
        self._newest[uid] = gen
        self._newest.move_to_end(uid)
        while len(self._newest) > NEWEST_PODS:
            self._newest.popitem(last=False)

    def report(self, uid: str, message: str, *args: object) -> None:
        """Log `message` once per pod UID (the last REPORTED_PODS remembered): marks are read at every filter
        and every reconcile, and a forged one must not flood the log."""
        with self._lock:
            if uid in self._reported:
                self._reported.move_to_end(uid)
                return
            self._reported[uid] = None
            while len(self._reported) > REPORTED_PODS:
                self._reported.popitem(last=False)
        log.info(message, *args)


def signed_mark(fields: Mapping[str, Any], key: MarkKey | None) -> str:
    """The JSON text of a mark with these fields, signed with `key` (unsigned without one)."""
    doc = {k: fields[k] for k in FIELDS}
    if fields.get("gen") is not None:
        doc["gen"] = fields["gen"]
    if key is not None:
        doc["sig"] = key.sign(doc)
    return json.dumps(doc)


def mark_accepted(
    mark: Mapping[str, Any], uid: str, key: MarkKey | None, *, where: str, text: str = ""
) -> bool:
    """Whether a parsed mark admits the pod with this UID: the mark names that UID and, with a key, carries
    its valid signature and a generation no older than the newest the key has seen for the pod (a mark the
    controller replaced, put back by the pod's owner, is refused). A refused mark is logged once per pod
    (`where`: the pod, for the log line).
    `text`: the JSON the mark was parsed from, when there is one (its check is then remembered)."""
    if not uid or mark.get("uid") != uid:
        if key is not None and uid:
            key.report(uid, "admission mark on pod %s refused: it names another pod's UID", where)
        return False
    if key is None:
        return True
    if not (key.verify_text(text, mark) if text else key.verify(mark)):
        why = "it is not signed" if "sig" not in mark else "its signature does not verify"
        key.report(
            uid, "admission mark on pod %s refused: %s (not written by the queue controller)", where, why
        )
        return False
    gen = mark.get("gen", 0)
    if isinstance(gen, bool) or not isinstance(gen, int) or not 0 <= gen <= MAX_GENERATION:
        key.report(uid, "admission mark on pod %s refused: its generation %r is not a number", where, gen)
        return False
    if not key.accept_generation(uid, gen):
        key.report(
            uid,
            "admission mark on pod %s refused: the queue controller has replaced it (generation %d, a newer "
            "one, %s, was seen)",
            where,
            gen,
            key.newest(uid),
        )
        return False
    return True


def load_mark_key(path: str | Path) -> MarkKey:
    """The key in the file `path`; AdmissionKeyError when it cannot be read or is too short."""
    path = Path(path)
    try:
        data = read_regular(path, MAX_KEY_FILE_BYTES)
    except OSError as exc:
        raise AdmissionKeyError(
            f"--admission-key-file {path}: cannot read it: {exc.strerror or exc}"
        ) from exc
    if len(data) > MAX_KEY_FILE_BYTES:
        raise AdmissionKeyError(f"--admission-key-file {path}: larger than {MAX_KEY_FILE_BYTES} bytes")
    secret = data.rstrip(b"\r\n")
    if len(secret) < MIN_KEY_BYTES:
        raise AdmissionKeyError(
            f"--admission-key-file {path}: {len(secret)} bytes of key, fewer than {MIN_KEY_BYTES}"
        )
    return MarkKey(secret, source=str(path))
