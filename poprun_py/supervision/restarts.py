"""Where a restart runs: the hosts left after failures, the wait before it, and how the job's
replicas spread over those hosts.

The number of replicas is the model's and stays for the whole job; instances are only where the
replicas run. So a restart after a lost host keeps every replica and gives each remaining host
more of them: the PopDist API and the engine see the same replicas in the same global order (and
the engine's reductions follow that order), so a job that resumes from a checkpoint ends with
the same bits as one that never failed. Imported only once a job has failed.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

from poprun_py.shared.errors import PlanError, printable_lines
from poprun_py.supervision import log

TYPE_CHECKING = False
if TYPE_CHECKING:
    from poprun_py.planning.plan import JobPlan

#: The longest wait before a restart (the backoff doubles up to it).
MAX_BACKOFF = 60.0
#: The longest a failed host is left out (its cooldown doubles with each failure, up to it).
MAX_COOLDOWN = 3600.0
#: How long --host-discovery-script may take, and how much it may print.
DISCOVERY_TIMEOUT = 30.0
DISCOVERY_MAX_BYTES = 1 << 20


def backoff(restart: int, base: float) -> float:
    """The wait before restart number ``restart`` (1 for the first): ``base``, doubled for each
    restart before it, at most MAX_BACKOFF."""
    return min(base * 2.0 ** (restart - 1), MAX_BACKOFF) if base > 0 else 0.0


def spread(replicas: int, per_host: int, hosts: list[str], slots: dict[str, int]) -> tuple[int, list[str]]:
    """``(instances, hosts used)`` for ``replicas`` on ``hosts``: as many of them (in their order) as
    the replicas spread over evenly, each with the same number of instances, the one nearest
    ``per_host`` (the job's instances per host at its start; on a tie the fewer) that divides its
    replicas and that every host used has ``slots`` for (a host without an entry has no limit)."""
    assert hosts and replicas >= 1 and per_host >= 1
    for count in range(len(hosts), 0, -1):
        if replicas % count:
            continue
        used = hosts[:count]
        room = min((slots[h] for h in used if h in slots), default=replicas)
        each = replicas // count
        choices = [k for k in range(1, min(each, room) + 1) if each % k == 0]
        best = min(choices, key=lambda k: (abs(k - per_host), k))
        return best * count, used
    raise AssertionError("one host always takes every replica")


@dataclass
class HostPool:
    """The hosts a job may use and, for each that failed, until when it is left out.

    ``size``: the most hosts a start uses, the number the job started with; a discovery script's
    new hosts join up to it."""

    hosts: list[str]
    cooldown: float
    size: int = 0
    #: Instances a host can take: the slots its source gave (a host file, a scheduler, the
    #: discovery script's ``host:slots``).
    slots: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    #: When (time.monotonic) each failed host's cooldown ends.
    until: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.size = self.size or len(self.hosts)

    def failed(self, host: str, now: float) -> float:
        """Leave ``host`` out for its cooldown, doubled for each time it failed before; how long."""
        count = self.failures[host] = self.failures.get(host, 0) + 1
        wait = min(self.cooldown * 2.0 ** (count - 1), MAX_COOLDOWN)
        self.until[host] = now + wait
        return wait

    def discovered(self, found: list[tuple[str, int | None]]) -> None:
        """The discovery script's hosts replace the known ones, in its order."""
        self.hosts = [host for host, _ in found]
        self.slots = {host: slots for host, slots in found if slots is not None}

    def usable(self, now: float) -> list[str]:
        """The hosts not cooling down at ``now``, at most ``size``, in order."""
        return [h for h in self.hosts if self.until.get(h, 0.0) <= now][:self.size]

    def cooling(self, now: float) -> dict[str, float]:
        """Each known host still left out at ``now``: the seconds until it is tried again."""
        return {h: self.until[h] - now for h in self.hosts if self.until.get(h, 0.0) > now}


def parse_discovered(text: str, script: str) -> list[tuple[str, int | None]]:
    """Horovod's host discovery contract: one ``host`` or ``host:slots`` per line (blank lines
    and ``#`` comments skipped). A malformed line is a PlanError naming it."""
    from poprun_py.planning.hosts import checked

    found: list[tuple[str, int | None]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, colon, count = line.partition(":")
        if colon and not (count.isascii() and count.isdigit() and 0 < int(count) <= 65536):
            raise PlanError(f"--host-discovery-script {script} printed {line[:80]!r} on line {number}; each line is "
                            "'host' or 'host:slots' with slots a whole number from 1")
        found.append((host.strip(), int(count) if colon else None))
    checked([host for host, _ in found], f"--host-discovery-script {script}")
    return found


def discover(script: str) -> list[tuple[str, int | None]]:
    """Ask ``script`` for the hosts available now; a PlanError saying why when it cannot run, fails,
    takes longer than DISCOVERY_TIMEOUT, prints too much, or lists no hosts."""
    try:
        done = subprocess.run([script], stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=DISCOVERY_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise PlanError(f"--host-discovery-script {script} took longer than {DISCOVERY_TIMEOUT:.0f} s") from None
    except OSError as exc:
        raise PlanError(f"--host-discovery-script {script} cannot run: {exc.strerror or exc}") from None
    if done.returncode:
        said = printable_lines(done.stderr.decode(errors="replace").strip())[-1][:200]
        raise PlanError(f"--host-discovery-script {script} exited with status {done.returncode}"
                        + (f" ({said})" if said else ""))
    if len(done.stdout) > DISCOVERY_MAX_BYTES:
        raise PlanError(f"--host-discovery-script {script} printed more than {DISCOVERY_MAX_BYTES} bytes")
    found = parse_discovered(done.stdout.decode(errors="replace"), script)
    if not found:
        raise PlanError(f"--host-discovery-script {script} listed no hosts")
    return found


@dataclass
class Layout:
    """How a start places the job: its instances and the hosts they run on."""

    num_instances: int
    hosts: list[str]


class Restarts:
    """The hosts of each start after the first: the failed ones left out, a discovery script's asked."""

    @classmethod
    def for_plan(cls, plan: JobPlan, min_hosts: int, cooldown: float, discovery_script: str | None,
                 slots: dict[str, int] | None = None) -> Restarts:
        """The restarts of the job whose first start ran ``plan`` on hosts with ``slots``."""
        return cls(Layout(plan.num_instances, list(plan.hosts)), plan.num_replicas, min_hosts=min_hosts,
                   cooldown=cooldown, discovery_script=discovery_script, slots=slots)

    def __init__(self, layout: Layout, replicas: int, *, min_hosts: int, cooldown: float,
                 discovery_script: str | None, slots: dict[str, int] | None = None) -> None:
        self.replicas = replicas
        self.per_host = layout.num_instances // max(len(layout.hosts), 1)
        self.pool = HostPool(list(layout.hosts), cooldown, slots=dict(slots or {}))
        self.first_hosts = set(layout.hosts)
        self.min_hosts = min_hosts
        self.discovery_script = discovery_script

    def next_layout(self, current: Layout, lost: dict[str, str], now: float | None = None) -> tuple[Layout, str]:
        """The layout of the next start after ``current`` lost the hosts ``lost`` (host: why),
        and one line saying what changed ("" when nothing did). A PlanError when fewer than
        --min-hosts are left."""
        if not current.hosts:  # this machine only: nothing to leave out
            return current, ""
        now = time.monotonic() if now is None else now
        for host in lost:
            self.pool.failed(host, now)
        if self.discovery_script is not None:
            try:
                self.pool.discovered(discover(self.discovery_script))
            except PlanError as exc:
                log.warning("%s: keeping the hosts known before", exc)
        hosts = self.pool.usable(now)
        cooling = self.pool.cooling(now)
        if len(hosts) < self.min_hosts:
            out = "; ".join(f"{h} for {left:.0f} s" for h, left in cooling.items())
            raise PlanError(f"not restarting: {len(hosts)} host(s) left ({', '.join(hosts) or 'none'}), fewer than "
                            f"--min-hosts {self.min_hosts}" + (f"; left out after failing: {out}" if out else ""))
        instances, used = spread(self.replicas, self.per_host, hosts, self.pool.slots)
        layout = Layout(instances, used)
        if layout == current:
            return layout, ""
        return layout, self._describe(current, layout, lost, hosts, cooling)

    def _describe(self, old: Layout, new: Layout, lost: dict[str, str], usable: list[str],
                  cooling: dict[str, float]) -> str:
        before, now = set(old.hosts), set(new.hosts)
        gone = [h for h in old.hosts if h not in now]
        added = [h for h in new.hosts if h not in before]
        parts = []
        if gone:
            why = [f"{h} ({'lost' if h in lost else 'left out'}"
                   + (f", tried again in {cooling[h]:.0f} s" if h in cooling else "") + ")" for h in gone]
            parts.append("without " + ", ".join(why))
        for kind, hosts in (("again", [h for h in added if h in self.pool.failures]),
                            ("", [h for h in added if h not in self.pool.failures and h in self.first_hosts]),
                            ("(discovered)", [h for h in added if h not in self.first_hosts])):
            if hosts:
                parts.append(f"with {', '.join(hosts)}" + (f" {kind}" if kind else ""))
        idle = [h for h in usable if h not in now]
        if idle:
            parts.append(f"{', '.join(idle)} idle ({self.replicas} replicas do not spread evenly over "
                         f"{len(usable)} hosts)")
        per_instance = self.replicas // new.num_instances
        return (f"the restart runs on {len(new.hosts)} host(s) {', '.join(parts)}: {new.num_instances} instance(s) x "
                f"{per_instance} local replica(s) = {self.replicas} replicas (before: {old.num_instances} x "
                f"{self.replicas // old.num_instances} on {len(old.hosts)} host(s))")
