"""Authentication of the control channel between poprun and the hosts' supervisors.

poprun's control port is open to whoever can reach it (on a multi-host job, anyone on the
network), so nothing read from it is believed unless it is sealed with this run's secret:

- poprun makes a secret for each run of the job (``new_secret``) and hands it to the hosts'
  supervisors in the environment (``environment.SECRET``), never on a command line; the programs
  never get it.
- On each connection poprun speaks first: a fresh nonce. Both sides derive the connection's key
  from the secret and that nonce, so what was recorded on one connection is worth nothing on
  another.
- Every frame, either way, ends with a tag: HMAC-SHA256 under that key over the direction, the
  frame's number on the connection and the frame itself (cut to ``TAG_SIZE`` bytes). A frame
  replayed, reordered, sent the other way or changed fails its check.

A host's supervisor seals its HELLO and checks its program before the programs can start, so
HMAC is computed here (RFC 2104) on the interpreter's own small SHA-256 (``_sha256``): :mod:`hmac`
loads OpenSSL's ``_hashlib``, about 5 ms of CPU and 4 MB resident in every host's supervisor and in
poprun before mpiexec starts. That SHA-256 is slower per byte, so a connection moves to OpenSSL's once it has
hashed about as much as loading it costs (``FAST_AFTER_BYTES``): a chatty program's output, not a
quiet job's handshake. Both give the same tags.
"""

from __future__ import annotations

import os
import struct
from _operator import _compare_digest as compare_digest  # what hmac.compare_digest is, without OpenSSL

from poprun_py.wire.protocol import NONCE_SIZE, TAG_SIZE

try:
    from _sha256 import sha256 as _small_sha256  # Python 3.11 (3.12 renamed it: there, hashlib's)
except ImportError:
    from hashlib import sha256 as _small_sha256

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing under python -S
if TYPE_CHECKING:
    from collections.abc import Callable
    from hashlib import _Hash

SECRET_BYTES = 32
#: Which way a frame goes, and its number on the connection: what a tag covers besides the frame.
_POSITION = struct.Struct("!BQ")
TO_POPRUN, TO_HOST = 1, 2
_CONTEXT = b"poprun control channel"
#: SHA-256's block: an HMAC key is padded to it.
_BLOCK = 64
#: Each byte of the padded key XORed with HMAC's ipad and opad, as translation tables.
_INNER, _OUTER = bytes(x ^ 0x36 for x in range(256)), bytes(x ^ 0x5C for x in range(256))
#: Bytes a connection hashes with the interpreter's small SHA-256 before it loads OpenSSL's: on a
#: 2-core AMD EPYC the small one took ~14 ns a byte more, and loading OpenSSL ~5 ms, as much as
#: ~360 KB: past this, a connection that goes on hashing pays at most twice the best of the two.
FAST_AFTER_BYTES = 256 * 1024


def new_secret() -> str:
    """A run's secret, as text for the environment."""
    return os.urandom(SECRET_BYTES).hex()


def new_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


def _pads(key: bytes, sha256: Callable[[], _Hash]) -> tuple[_Hash, _Hash]:
    """HMAC's inner and outer hashes with the key's blocks absorbed (``key`` at most a block)."""
    key = key.ljust(_BLOCK, b"\0")
    inner, outer = sha256(), sha256()
    inner.update(key.translate(_INNER))
    outer.update(key.translate(_OUTER))
    return inner, outer


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    """HMAC-SHA256 of ``message`` (``hmac.digest(key, message, "sha256")``) on the small SHA-256."""
    if len(key) > _BLOCK:
        key = _small_sha256(key).digest()
    inner, outer = _pads(key, _small_sha256)
    inner.update(message)
    outer.update(inner.digest())
    return outer.digest()


class Seal:
    """One end of one connection: its key, and the number of frames sealed and checked so far.

    ``sending``: the direction this end sends in (``TO_POPRUN`` for a host's supervisor, ``TO_HOST`` for poprun).
    """

    def __init__(self, secret: str, nonce: bytes, sending: int) -> None:
        self._key = hmac_sha256(secret.encode(), _CONTEXT + nonce)
        self._inner, self._outer = _pads(self._key, _small_sha256)
        #: Bytes hashed with the small SHA-256 so far (``FAST_AFTER_BYTES``); None once on OpenSSL's.
        self._small_bytes: int | None = 0
        self._sending = sending
        self._receiving = TO_HOST if sending == TO_POPRUN else TO_POPRUN
        self._sent = 0
        self._checked = 0

    def _tag(self, direction: int, number: int, data: bytes) -> bytes:
        if self._small_bytes is not None:
            self._small_bytes += len(data)
            if self._small_bytes > FAST_AFTER_BYTES:
                from hashlib import sha256

                self._inner, self._outer = _pads(self._key, sha256)
                self._small_bytes = None
        inner, outer = self._inner.copy(), self._outer.copy()
        inner.update(_POSITION.pack(direction, number))
        inner.update(data)
        outer.update(inner.digest())
        return outer.digest()[:TAG_SIZE]

    def seal(self, data: bytes) -> bytes:
        """``data`` (one whole frame) with its tag appended."""
        tag = self._tag(self._sending, self._sent, data)
        self._sent += 1
        return data + tag

    def check(self, data: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is the next frame's from the other end for ``data``."""
        good = compare_digest(tag, self._tag(self._receiving, self._checked, data))
        if good:
            self._checked += 1
        return good
