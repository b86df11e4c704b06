"""The reference rendering of an instance's output, to compare poprun's tagging with."""

from __future__ import annotations


def rendered(data: bytes, tag: bytes = b"[0] ") -> bytes:
    """What poprun writes for one instance's ``data``: a tag before the first printable byte of each
    line and again after each carriage return that the line continues after; a carriage return
    that moves nothing (at a line's start, after another) is dropped; a last line gets a newline."""
    out = []
    lines = data.split(b"\n")
    for number, line in enumerate(lines):
        parts = [part for part in line.split(b"\r") if part]
        last = number == len(lines) - 1
        if last and not parts:
            break
        text = b"\r".join(tag + part for part in parts) if parts else tag
        if parts and line.endswith(b"\r"):
            text += b"\r"
        out.append(text + b"\n")
    return b"".join(out)
