"""The reference rendering of an instance's output, to compare poprun's tagging with."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.helpers import PYTHON, ROOT, SUBPROCESS_TIMEOUT

#: print, logging on stderr, a line begun on stdout and ended on stderr, a tqdm bar and the print
#: after it, so many rounds, and unfinished lines at the end (issue 40).
TWO_STREAMS = str(ROOT / "tests" / "scripts" / "two_streams.py")


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


def instances_text(shown: bytes) -> dict[int, bytes]:
    """Each instance's text in what poprun showed of several: its tagged pieces, in order, without
    the tags, carriage returns and newlines (poprun may end an instance's line for another, or a
    bar's redraw, with a newline of its own). Every piece must be tagged, and no line may hold
    two instances."""
    assert shown.endswith(b"\n"), f"poprun's last line is not ended: {shown[-200:]!r}"
    texts: dict[int, bytearray] = {}
    for line in shown.split(b"\n")[:-1]:
        owner = None
        for piece in (piece for piece in line.split(b"\r") if piece):
            match = re.fullmatch(rb"\[(\d+)\] (.*)", piece, re.DOTALL)
            assert match, f"an untagged piece {piece!r} in {line!r}"
            index = int(match.group(1))
            assert owner in (None, index), f"two instances on one line: {line!r}"
            owner = index
            texts.setdefault(index, bytearray()).extend(match.group(2))
    return {index: bytes(text) for index, text in texts.items()}


def flat(data: bytes) -> bytes:
    """``data`` without carriage returns and newlines: the text that :func:`instances_text` compares."""
    return data.replace(b"\r", b"").replace(b"\n", b"")


def without_poprun(tmp_path: Path, rounds: int, one_file: bool = True) -> tuple[bytes, bytes]:
    """What TWO_STREAMS writes run alone: ``> out 2>&1`` (out, b"") or ``> out 2> err`` (out, err);
    with PYTHONUNBUFFERED=1, as poprun runs it."""
    out_path, err_path = tmp_path / "alone.out", tmp_path / "alone.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        subprocess.run([PYTHON, TWO_STREAMS, str(rounds)], stdin=subprocess.DEVNULL, stdout=out,
                       stderr=subprocess.STDOUT if one_file else err, check=True, timeout=SUBPROCESS_TIMEOUT,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=ROOT)
    return out_path.read_bytes(), err_path.read_bytes()
