"""Authentication of the control channel between poprun and its shims.

poprun's control port is open to whoever can reach it (on a multi-host job, anyone on the
network), so nothing read from it is believed unless it is sealed with this run's secret:

- poprun makes a secret for each run of the job (``new_secret``) and hands it to the shims in
  the environment (``environment.SECRET``), never on a command line; the shim removes it before
  it starts the program.
- On each connection poprun speaks first: a fresh nonce. Both sides derive the connection's key
  from the secret and that nonce, so what was recorded on one connection is worth nothing on
  another.
- Every frame, either way, ends with a tag: HMAC-SHA256 under that key over the direction, the
  frame's number on the connection and the frame itself (cut to ``TAG_SIZE`` bytes). A frame
  replayed, reordered, sent the other way or changed fails its check.

Built on :mod:`hmac` (standard library); imported by the shim after its program has started.
"""

from __future__ import annotations

import hmac
import os
import struct

from poprun_py.wire.protocol import NONCE_SIZE, TAG_SIZE

SECRET_BYTES = 32
#: Which way a frame goes, and its number on the connection: what a tag covers besides the frame.
_POSITION = struct.Struct("!BQ")
TO_POPRUN, TO_SHIM = 1, 2
_CONTEXT = b"poprun control channel"


def new_secret() -> str:
    """A run's secret, as text for the environment."""
    return os.urandom(SECRET_BYTES).hex()


def new_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


class Seal:
    """One end of one connection: its key, and the number of frames sealed and checked so far.

    ``sending``: the direction this end sends in (``TO_POPRUN`` for a shim, ``TO_SHIM`` for poprun).
    """

    def __init__(self, secret: str, nonce: bytes, sending: int) -> None:
        self._key = hmac.digest(secret.encode(), _CONTEXT + nonce, "sha256")
        self._sending = sending
        self._receiving = TO_SHIM if sending == TO_POPRUN else TO_POPRUN
        self._sent = 0
        self._checked = 0

    def _tag(self, direction: int, number: int, data: bytes) -> bytes:
        mac = hmac.new(self._key, _POSITION.pack(direction, number), "sha256")
        mac.update(data)
        return mac.digest()[:TAG_SIZE]

    def seal(self, data: bytes) -> bytes:
        """``data`` (one whole frame) with its tag appended."""
        tag = self._tag(self._sending, self._sent, data)
        self._sent += 1
        return data + tag

    def check(self, data: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is the next frame's from the other end for ``data``."""
        good = hmac.compare_digest(tag, self._tag(self._receiving, self._checked, data))
        if good:
            self._checked += 1
        return good
