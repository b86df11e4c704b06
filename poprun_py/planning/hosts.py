"""Host lists: ``a,b``, range form ``node[0-2,4]`` (zero padding kept; Slurm's node lists, as in
``SLURM_JOB_NODELIST``, read the same), and host files."""

from __future__ import annotations

import re
from pathlib import Path

from poprun_py.shared.errors import PlanError

_BRACKET = re.compile(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$")
_RANGE = re.compile(r"^([0-9]{1,18})(?:-([0-9]{1,18}))?$")
#: At most one host per instance (command.MAX_COUNT): a longer list is refused before it is expanded.
MAX_HOSTS = 65536
#: A host file is a few thousand short lines; it is not read past 16 MiB or 1 Mi lines.
MAX_HOST_FILE_BYTES = 16 << 20
MAX_HOST_FILE_LINES = 1 << 20
#: A host name (a DNS name) has at most this many characters.
MAX_NAME = 253


def _shown(text: str, keep: int = 60) -> str:
    return text if len(text) <= keep else text[:keep] + "..."


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


def _groups(item: str, whole: str) -> tuple[str, list[tuple[int, int, int]], str] | None:
    """``prefix``, the ranges ``(low, high, width)`` and the rest of ``item``'s first bracket
    group; None for a plain name. Errors name the ``whole`` pattern."""
    if "[" not in item and "]" not in item:
        return None
    match = _BRACKET.match(item)
    if not match:
        raise PlanError(f"host pattern {_shown(whole)!r} is malformed; valid forms are 'name' or "
                        "'prefix[0-3,5]suffix'")
    prefix, ranges, suffix = match.groups()
    parsed = []
    for part in ranges.split(","):
        part = part.strip()
        range_match = _RANGE.match(part)
        if not range_match:
            raise PlanError(f"host range {_shown(part)!r} in {_shown(whole)!r} is not 'N' or 'N-M' with "
                            "non-negative integers (at most 18 digits)")
        low_text, high_text = range_match.groups()
        high_text = high_text if high_text is not None else low_text
        low, high = int(low_text), int(high_text)
        if high < low:
            raise PlanError(f"host range {part!r} in {_shown(whole)!r} runs backwards; write it as {high}-{low}")
        # Slurm's rule: a range written with leading zeros keeps the width of its first number.
        width = len(low_text) if low_text.startswith("0") and len(low_text) > 1 else 0
        parsed.append((low, high, width))
    return prefix, parsed, suffix


def _count_one(item: str, whole: str) -> int:
    """How many names ``item`` expands to, without expanding it."""
    groups = _groups(item, whole)
    if groups is None:
        return 1
    _, ranges, suffix = groups
    return sum(high - low + 1 for low, high, _ in ranges) * _count_one(suffix, whole)


def _expand_one(item: str, whole: str) -> list[str]:
    """One name, its bracket groups expanded left to right (``r[1-2]n[01-02]``: 4 names)."""
    groups = _groups(item, whole)
    if groups is None:
        return [item]
    prefix, ranges, suffix = groups
    tails = _expand_one(suffix, whole)
    return [f"{prefix}{n:0{width}d}{tail}" for low, high, width in ranges
            for n in range(low, high + 1) for tail in tails]


def _items(spec: str) -> list[str]:
    if spec.count("[") != spec.count("]"):
        raise PlanError(f"host list {_shown(spec)!r} has unbalanced brackets")
    return [item.strip() for item in _split_top_level(spec) if item.strip()]


def count_hosts(spec: str) -> int:
    """How many hosts ``spec`` names (checked, not expanded)."""
    return sum(_count_one(item, item) for item in _items(spec))


def expand_hosts(spec: str) -> list[str]:
    """Expand ``"node[0-2],gpu7"`` into ``["node0", "node1", "node2", "gpu7"]``; a list of more
    than MAX_HOSTS is refused before it is built, and so is one with a host twice or a bad name."""
    return checked(_expand(spec), f"host list {_shown(spec)!r}")


def _expand(spec: str) -> list[str]:
    count = count_hosts(spec)
    if count > MAX_HOSTS:
        raise PlanError(f"host list {_shown(spec)!r} names {count} hosts, more than poprun runs on "
                        f"(at most {MAX_HOSTS}, one instance per host at least)")
    hosts = [host for item in _items(spec) for host in _expand_one(item, item)]
    if not hosts:
        raise PlanError(f"host list {_shown(spec)!r} names no hosts; give e.g. 'host0,host1' or 'node[0-3]'")
    return hosts


def read_host_file(path: str | Path) -> list[str]:
    """One host (or host pattern) per line; blank lines and ``#`` comments are ignored.

    A trailing ``slots=N`` (Open MPI hostfile style) is tolerated and ignored. The file is read
    in bounded time and memory (see ``user_files.read_text``), its hosts counted before any is expanded.
    """
    from poprun_py.planning.user_files import read_text

    try:
        text = read_text(str(path), MAX_HOST_FILE_BYTES, "16 MiB; a host file holds one host name per line")
    except ValueError as exc:
        raise PlanError(f"host file {str(path)!r} {exc}") from None
    if text.count("\n") > MAX_HOST_FILE_LINES:
        raise PlanError(f"host file {str(path)!r} has more than {MAX_HOST_FILE_LINES} lines; "
                        "it holds one host name per line")
    patterns = [line.split()[0] for line in (raw.split("#", 1)[0].strip() for raw in text.splitlines()) if line]
    count = sum(count_hosts(pattern) for pattern in patterns)
    if count > MAX_HOSTS:
        raise PlanError(f"host file {str(path)!r} names {count} hosts, more than poprun runs on "
                        f"(at most {MAX_HOSTS}, one instance per host at least)")
    hosts = [host for pattern in patterns for host in _expand(pattern)]
    if not hosts:
        raise PlanError(f"host file {str(path)!r} lists no hosts; put one host name per line")
    return checked(hosts, f"host file {str(path)!r}")


def checked(hosts: list[str], source: str) -> list[str]:
    """``hosts``, given by ``source``, when each could be a host's name and none is listed twice:
    poprun spreads the instances evenly over the hosts, so a host listed twice would get two shares
    and each would be told it is alone there (LOCAL_RANK 0, LOCAL_WORLD_SIZE 1)."""
    first: dict[str, int] = {}
    for position, host in enumerate(hosts):
        if len(host) > MAX_NAME:
            raise PlanError(f"{source} names a host of {len(host)} characters ({_shown(host)!r}); "
                            f"a host name has at most {MAX_NAME}")
        if not host.isprintable() or any(c.isspace() for c in host):
            raise PlanError(f"{source} names the host {_shown(host)!r}, which holds a space or a control character")
        if host in first:
            raise PlanError(f"{source} lists the host {host!r} twice (hosts {first[host]} and {position}); list each "
                            "host once: poprun spreads the instances evenly over the hosts")
        first[host] = position
    return hosts
