"""Signed queue admission marks: the one place both the queue controller and the extender sign and check them.

The controller admits a queued pod by writing gpunode.io/queue-admitted (JSON {"job", "uid", "node", "gpus",
"at"}); the extender lets the pod through only with such a mark. The UID binding stops a mark put on a pod
when it is created, but the pod's owner may patch its pods (the `edit` ClusterRole allows it), read the UID
and write a mark afterwards. With a shared secret key (--admission-key-file on `gpunode queue` and
`gpunode extender`) the controller adds "sig": HMAC-SHA256 over the canonical JSON of the five fields
(sorted keys, no spaces, ASCII) after a domain prefix, base64url without padding. Only the holders of the
key can write a mark that verifies, and the UID inside the signed text keeps a valid mark from being
copied onto another pod.

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
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
UNSIGNED_WARNING = (
    "queue admissions are NOT signed (no --admission-key-file): any tenant able to patch its own pods can "
    "write an admission mark and skip the queue; give the controller and the extender the same key file"
)


def canonical(fields: Mapping[str, Any]) -> bytes:
    """The bytes a mark's signature covers: the domain, then the JSON of its FIELDS (absent ones as null)."""
    doc = {k: fields.get(k) for k in FIELDS}
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
    if key is not None:
        doc["sig"] = key.sign(doc)
    return json.dumps(doc)


def mark_accepted(
    mark: Mapping[str, Any], uid: str, key: MarkKey | None, *, where: str, text: str = ""
) -> bool:
    """Whether a parsed mark admits the pod with this UID: the mark names that UID and, with a key, carries
    its valid signature. A refused mark is logged once per pod (`where`: the pod, for the log line).
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
    return True


def load_mark_key(path: str | Path) -> MarkKey:
    """The key in the file `path`; AdmissionKeyError when it cannot be read or is too short."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
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
