"""Files the user names (a host file, a config file), read in bounded time and memory."""

from __future__ import annotations

import os


def read_text(path: str, limit: int, limit_text: str) -> str:
    """The UTF-8 text of the file at ``path``, read in bounded time and memory: at most ``limit``
    bytes (``/dev/zero`` is refused, not read for ever) and a FIFO nobody writes to reads as
    empty instead of waiting. ValueError (a message to follow the path) if it cannot be read, is
    larger than ``limit`` ("is larger than ``limit_text``"), or is not UTF-8 text."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO does not wait
        try:
            os.set_blocking(fd, True)
            chunks, size = [], 0
            while size <= limit:
                chunk = os.read(fd, min(1 << 20, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc.strerror or exc}") from None
    data = b"".join(chunks)
    if len(data) > limit:
        raise ValueError(f"is larger than {limit_text}")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\0" in data:
        raise ValueError("is binary or UTF-16, not text: save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
                         "save it as UTF-8") from None
