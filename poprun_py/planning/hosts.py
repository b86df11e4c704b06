"""Host lists: ``a,b``, range form ``node[0-2,4]`` (zero padding kept; Slurm's node lists, as in
``SLURM_JOB_NODELIST``, read the same), and host files with the slots they give hosts."""

from __future__ import annotations

import re

from poprun_py.shared.errors import PlanError

TYPE_CHECKING = False  # typing.TYPE_CHECKING; pathlib (with urllib and ipaddress, ~3 ms) stays off the launch path
if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from typing import TypeVar

    T = TypeVar("T")

_BRACKET = re.compile(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$")
_RANGE = re.compile(r"^([0-9]{1,18})(?:-([0-9]{1,18}))?$")
#: At most one host per instance (command.MAX_COUNT): a longer list is refused before it is expanded.
MAX_HOSTS = 65536
#: A host file is a few thousand short lines; it is not read past 16 MiB or 1 Mi lines.
MAX_HOST_FILE_BYTES = 16 << 20
MAX_HOST_FILE_LINES = 1 << 20
#: A host name (a DNS name) has at most this many characters.
MAX_NAME = 253


def abridged(text: str, keep: int = 60) -> str:
    """``text`` as an error line shows it: its first ``keep`` characters and "..." when longer."""
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
        raise PlanError(f"host pattern {abridged(whole)!r} is malformed; valid forms are 'name' or "
                        "'prefix[0-3,5]suffix'")
    prefix, ranges, suffix = match.groups()
    parsed = []
    for part in ranges.split(","):
        part = part.strip()
        range_match = _RANGE.match(part)
        if not range_match:
            raise PlanError(f"host range {abridged(part)!r} in {abridged(whole)!r} is not 'N' or 'N-M' with "
                            "non-negative integers (at most 18 digits)")
        low_text, high_text = range_match.groups()
        high_text = high_text if high_text is not None else low_text
        low, high = int(low_text), int(high_text)
        if high < low:
            raise PlanError(f"host range {part!r} in {abridged(whole)!r} runs backwards; write it as {high}-{low}")
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
        raise PlanError(f"host list {abridged(spec)!r} has unbalanced brackets")
    return [item.strip() for item in _split_top_level(spec) if item.strip()]


def count_hosts(spec: str) -> int:
    """How many hosts ``spec`` names (checked, not expanded)."""
    return sum(_count_one(item, item) for item in _items(spec))


def expand_hosts(spec: str, shown: str | None = None) -> list[str]:
    """Expand ``"node[0-2],gpu7"`` into ``["node0", "node1", "node2", "gpu7"]``; a list of more
    than MAX_HOSTS is refused before it is built, and so is one with a host twice or a bad name
    (``shown``: how that error names the list, e.g. by the variable that gave it)."""
    return checked(_expand(spec), shown or f"host list {abridged(spec)!r}")


def _expand(spec: str) -> list[str]:
    count = count_hosts(spec)
    if count > MAX_HOSTS:
        raise PlanError(f"host list {abridged(spec)!r} names {count} hosts, more than poprun runs on "
                        f"(at most {MAX_HOSTS}, one instance per host at least)")
    hosts = [host for item in _items(spec) for host in _expand_one(item, item)]
    if not hosts:
        raise PlanError(f"host list {abridged(spec)!r} names no hosts; give e.g. 'host0,host1' or 'node[0-3]'")
    return hosts


def read_host_file(path: str | Path, shown: str | None = None) -> tuple[list[str], dict[str, int]]:
    """The hosts of a host file and the slots it gives them: one host (or host pattern) per line,
    optionally with its slots as Open MPI's ``host slots=N`` (the Kubernetes MPI Operator's form)
    or Hydra's ``host:N``; blank lines and ``#`` comments are ignored, and so are other words
    after the host (Open MPI's ``max_slots=N``). Slots bound the instances a host gets.

    The file is read in bounded time and memory (see ``user_files.read_text``), its hosts counted
    before any is expanded; a malformed line is a PlanError naming the file (as ``shown`` says,
    e.g. by the variable that gave it) and the line."""
    shown = shown or f"host file {str(path)!r}"
    text = read_bounded(path, shown, "one host name per line")
    entries: list[tuple[int, str, int | None]] = []
    for number, line in lines_of(text):
        words = line.split()
        pattern, slots = words[0], None
        name, colon, after = pattern.rpartition(":")
        if colon and "[" not in after and ":" not in name:
            pattern, slots = name, slot_count(after, shown, number, line, HOST_FILE_FORM)
        for word in words[1:]:
            key, equals, value = word.partition("=")
            if equals and key == "slots":
                slots = slot_count(value, shown, number, line, HOST_FILE_FORM)
        entries.append((number, pattern, slots))
    count = sum(_on_line(count_hosts, pattern, shown, number) for number, pattern, _ in entries)
    if count > MAX_HOSTS:
        raise PlanError(f"{shown} names {count} hosts, more than poprun runs on "
                        f"(at most {MAX_HOSTS}, one instance per host at least)")
    hosts: list[str] = []
    slots_of: dict[str, int] = {}
    for number, pattern, slots in entries:
        for host in _on_line(_expand, pattern, shown, number):
            hosts.append(host)
            if slots is not None:
                slots_of[host] = slots
    if not hosts:
        raise PlanError(f"{shown} lists no hosts; put one host name per line")
    return checked(hosts, shown), slots_of


def _on_line(read: Callable[[str], T], pattern: str, shown: str, number: int) -> T:
    """``read(pattern)``, a host file's line ``number``; its PlanError names the file and the line."""
    try:
        return read(pattern)
    except PlanError as exc:
        raise PlanError(f"{shown} line {number}: {exc}") from None


#: What a line of a host file may be.
HOST_FILE_FORM = "'host', 'host slots=N' or 'host:N', with N a whole number from 1"
#: The most slots one host may have (as many as instances poprun starts).
MAX_SLOTS = 65536


def read_bounded(path: str | Path, shown: str, holds: str) -> str:
    """The text of the host file ``path`` (``shown``: how errors name it; ``holds``: what its lines
    are), read in bounded time and memory; a PlanError naming it when it cannot be read, is too
    large or has too many lines."""
    from poprun_py.planning.user_files import read_text

    try:
        text = read_text(str(path), MAX_HOST_FILE_BYTES, f"16 MiB; a host file holds {holds}")
    except ValueError as exc:
        raise PlanError(f"{shown} {exc}") from None
    if text.count("\n") > MAX_HOST_FILE_LINES:
        raise PlanError(f"{shown} has more than {MAX_HOST_FILE_LINES} lines; it holds {holds}")
    return text


def lines_of(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of each line that holds more than a ``#`` comment, stripped."""
    stripped = ((number, raw.split("#", 1)[0].strip()) for number, raw in enumerate(text.splitlines(), 1))
    return [(number, line) for number, line in stripped if line]


def slot_count(value: str, shown: str, number: int, line: str, form: str) -> int:
    """``value`` as a number of slots: a whole number from 1 to MAX_SLOTS; else a PlanError
    naming ``shown``'s line ``number`` (0: a variable, which has no lines) and what its lines may
    be (``form``)."""
    if value.isascii() and value.isdigit() and 0 < int(value) <= MAX_SLOTS:
        return int(value)
    where = f"{shown} line {number}: {abridged(line)!r}" if number else f"{shown} {abridged(line)!r}"
    each = "each line is" if number else "it is"
    raise PlanError(f"{where} gives {abridged(value, 20)!r} slots; {each} {form} (at most {MAX_SLOTS})")


#: What a host may be, said when one is refused.
HOST_FORM = ("a host is a name of ASCII letters, digits, '-' and '_' in labels joined by '.' (RFC 1123: no label "
             "begins or ends with '-'; at most 63 characters each) or an IPv4 address, optionally after 'user@'")
_NAME_CHARACTERS = re.compile(r"[A-Za-z0-9_.@-]*")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _not_a_host(host: str) -> str | None:
    """Why ``host`` cannot be a host's name (None: it can). Every source's hosts reach ssh, a
    launcher agent and mpiexec's command line and host files, which read a leading '-' as an
    option and hand the name to a shell on the other side: only :data:`HOST_FORM` gets there."""
    if host.startswith("-"):
        return "begins with '-' (ssh and mpiexec would read it as an option)"
    if not _NAME_CHARACTERS.fullmatch(host):
        bad = next(c for c in host if not _NAME_CHARACTERS.fullmatch(c))
        if bad == ":":
            return ("holds ':' (a host file gives a host's slots as 'host:N'; an IPv6 address cannot be given, "
                    "mpiexec's host lists read its ':' as slots: give the host's name)")
        return f"holds {bad!r}"
    user, at, name = host.rpartition("@")
    if at and not _USER.fullmatch(user):
        return f"has {user!r} before '@', not a user name (letters, digits, '_', '.' and '-', not first)"
    for label in name.removesuffix(".").split("."):
        if not label:
            return "has an empty label (a '.' at its start, or two in a row)"
        if label.startswith("-") or label.endswith("-"):
            return f"has the label {label!r}, which begins or ends with '-'"
        if len(label) > 63:
            return f"has a label of {len(label)} characters"
    return None


def checked(hosts: list[str], source: str) -> list[str]:
    """``hosts``, given by ``source``, when each is a host's name (``_not_a_host``) and none is
    listed twice: poprun spreads the instances evenly over the hosts, so a host listed twice would
    get two shares and each would be told it is alone there (LOCAL_RANK 0, LOCAL_WORLD_SIZE 1).
    The one check of every source's hosts (-H, host files, schedulers, the discovery script)."""
    first: dict[str, int] = {}
    for position, host in enumerate(hosts):
        if len(host) > MAX_NAME:
            raise PlanError(f"{source} names a host of {len(host)} characters ({abridged(host)!r}); "
                            f"a host name has at most {MAX_NAME}")
        why = _not_a_host(host)
        if why:
            raise PlanError(f"{source} names the host {abridged(host)!r}, which {why}; {HOST_FORM}")
        if host in first:
            raise PlanError(f"{source} lists the host {host!r} twice (hosts {first[host]} and {position}); list each "
                            "host once: poprun spreads the instances evenly over the hosts")
        first[host] = position
    return hosts
