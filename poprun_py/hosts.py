"""Host lists: ``a,b``, range form ``node[0-2,4]`` (zero padding kept; Slurm's node lists, as in
``SLURM_JOB_NODELIST``, read the same), and host files."""

from __future__ import annotations

import re
from pathlib import Path

from poprun_py.errors import PlanError

_BRACKET = re.compile(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(spec: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def _expand_one(item: str, whole: str | None = None) -> list[str]:
    """One name, its bracket groups expanded left to right (``r[1-2]n[01-02]``: 4 names);
    errors name the ``whole`` pattern."""
    whole = whole or item
    if "[" not in item and "]" not in item:
        return [item]
    match = _BRACKET.match(item)
    if not match:
        raise PlanError(f"host pattern {whole!r} is malformed; valid forms are 'name' or 'prefix[0-3,5]suffix'")
    prefix, ranges, suffix = match.groups()
    tails = _expand_one(suffix, whole)
    names: list[str] = []
    for part in ranges.split(","):
        part = part.strip()
        range_match = _RANGE.match(part)
        if not range_match:
            raise PlanError(f"host range {part!r} in {whole!r} is not 'N' or 'N-M' with non-negative integers")
        low_text, high_text = range_match.groups()
        high_text = high_text if high_text is not None else low_text
        low, high = int(low_text), int(high_text)
        if high < low:
            raise PlanError(f"host range {part!r} in {whole!r} runs backwards; write it as {high}-{low}")
        # Slurm's rule: a range written with leading zeros keeps the width of its first number.
        width = len(low_text) if low_text.startswith("0") and len(low_text) > 1 else 0
        names.extend(f"{prefix}{n:0{width}d}{tail}" for n in range(low, high + 1) for tail in tails)
    return names


def expand_hosts(spec: str) -> list[str]:
    """Expand ``"node[0-2],gpu7"`` into ``["node0", "node1", "node2", "gpu7"]``."""
    if spec.count("[") != spec.count("]"):
        raise PlanError(f"host list {spec!r} has unbalanced brackets")
    hosts: list[str] = []
    for item in _split_top_level(spec):
        item = item.strip()
        if item:
            hosts.extend(_expand_one(item))
    if not hosts:
        raise PlanError(f"host list {spec!r} names no hosts; give e.g. 'host0,host1' or 'node[0-3]'")
    return hosts


def read_host_file(path: str | Path) -> list[str]:
    """One host (or host pattern) per line; blank lines and ``#`` comments are ignored.

    A trailing ``slots=N`` (Open MPI hostfile style) is tolerated and ignored.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PlanError(f"host file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    hosts: list[str] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.extend(expand_hosts(line.split()[0]))
    if not hosts:
        raise PlanError(f"host file {str(path)!r} lists no hosts; put one host name per line")
    return hosts
