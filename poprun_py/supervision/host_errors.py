"""Read what mpiexec and its ssh launcher said into one line per failed host.

When a host cannot be reached, mpiexec prints a page (Hydra's stack of ``[mpiexec@...]`` lines,
Open MPI's daemon-failure box) around the one line that matters, which ssh wrote. This finds
that line for each host of the job, so poprun can say "host node1: ssh: connect to host node1
port 22: Connection refused" and nothing else. Imported only when a job has failed.
"""

from __future__ import annotations

import re

from poprun_py.shared.errors import printable_lines

#: ssh's own messages, each naming the host (ssh writes names in lower case).
_SSH_PATTERNS = (
    re.compile(r"ssh: Could not resolve hostname (?P<host>[^:\s]+): (?P<why>.+)"),
    re.compile(r"ssh: connect to host (?P<host>\S+) port \d+: (?P<why>.+)"),
    re.compile(r"(?:\S+@)?(?P<host>[^@\s:]+): (?P<why>Permission denied \(.+\)\.?)"),
    re.compile(r"Connection (?:to|closed by) (?P<host>\S+?)(?: port \d+)? (?P<why>closed by remote host\.?|.*)"),
    re.compile(r"Timeout, server (?P<host>\S+) (?P<why>not responding\.?)"),
)
#: ssh's messages that name no host (or only an address): when nothing names a host, they are put
#: down to the hosts whose instances never started.
_SSH_ANONYMOUS = (
    re.compile(r"Connection timed out during banner exchange"),
    re.compile(r"kex_exchange_identification: .+"),
    re.compile(r"banner exchange: Connection to \S+ port \d+: .+"),
)
#: Open MPI's box for a daemon that never called back names the host on its own line.
_OPENMPI_REMOTE = re.compile(r"^\s*Remote host:\s+(?P<host>\S+)\s*$", re.MULTILINE)
_OPENMPI_STATUS = re.compile(r"Daemon exit status:\s+(?P<status>\d+)")


def launcher_text(chunks: list[bytes]) -> str:
    """The launcher's output as it came, as text: an ssh message translated in a locale that is not
    UTF-8 has bytes that are not, and each of those reads as U+FFFD instead of failing."""
    return b"".join(chunks).decode(errors="replace")


def host_failures(output: str, hosts: list[str], unstarted: list[str] | None = None,
                  launcher: str = "ssh") -> dict[str, str]:
    """``{host: what went wrong}`` for each of ``hosts`` that the launcher's ``output`` blames; when
    it names none, an ssh message that names no host is put down to each of ``unstarted`` (hosts
    whose instances never started). ``launcher``: what reached the hosts (ssh, or a launcher
    agent's name), as the messages name it. Their words are ``printable``: an agent's ESC or NUL
    is quoted as ``\x1b``, ``\x00``, not passed to poprun's terminal."""
    by_lower = {host.lower(): host for host in hosts}
    found: dict[str, str] = {}
    anonymous: str | None = None
    for line in _lines(output):
        for pattern in _SSH_PATTERNS:
            match = pattern.fullmatch(line)
            if match and match.group("host").lower() in by_lower:
                found.setdefault(by_lower[match.group("host").lower()], line)
                break
        else:
            if anonymous is None and any(pattern.fullmatch(line) for pattern in _SSH_ANONYMOUS):
                anonymous = f"{launcher}: {line}"
    if launcher != "ssh":
        # An agent's words are its own: a line of it that names one host is that host's failure.
        for line in agent_lines(output):
            named = [host for host in hosts if _names(line, host)]
            if len(named) == 1:
                found.setdefault(named[0], f"{launcher}: {line}")
            elif not named and anonymous is None:
                anonymous = f"{launcher}: {line}"
    for match in _OPENMPI_REMOTE.finditer(output):
        host = by_lower.get(match.group("host").lower())
        if host and host not in found:
            status = _OPENMPI_STATUS.search(output, match.end())
            found[host] = "Open MPI's daemon there did not call back" + \
                (f" (exit status {status.group('status')})" if status else "")
    if anonymous is not None and not found:
        for host in unstarted or []:
            found[host] = anonymous
    return found


def agent_lines(output: str) -> list[str]:
    """The lines of ``output`` that a launcher agent wrote: not mpiexec's own (Hydra's start with
    ``[``, Open MPI's messages sit between lines of dashes)."""
    lines, in_box = [], False
    for line in _lines(output):
        if line.startswith("-----"):
            in_box = not in_box
        elif line and not in_box and not line.startswith("["):
            lines.append(line)
    return lines


def _lines(output: str) -> list[str]:
    """``output``'s lines as poprun quotes them (``printable_lines``), stripped."""
    return [line.strip() for line in printable_lines(output)]


def _names(line: str, host: str) -> bool:
    """Whether ``line`` names ``host`` as a word of its own (``node1`` is not in ``node10``)."""
    return re.search(rf"(?<![\w.-]){re.escape(host)}(?![\w-]|\.\w)", line, re.IGNORECASE) is not None


def describe(failures: dict[str, str]) -> str:
    """One line for all failed hosts."""
    return "; ".join(f"host {host}: {why}" for host, why in failures.items())
