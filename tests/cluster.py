"""A real cluster on this machine: one network namespace per host, each with its own sshd.

Used by the multi-host tests and by ``make bench``. Each host is a network namespace with its
own UTS namespace (so its own hostname), one veth leg on a bridge in the root namespace, an
address in one private /24 that this module picks (a /24 that no local address or route
touches), no default route, and an sshd that accepts only this cluster's key, as root. The
root namespace reaches the hosts through the bridge's own address (``.1``). Host names resolve
through a marked block in ``/etc/hosts``; ssh finds the key, the host keys and its time-outs
through a file in ``/etc/ssh/ssh_config.d``. Both, the namespaces, the bridge and every process
of the hosts are removed again by ``stop`` (and what a crashed run left is removed by the next
``start``).

Traffic goes only to addresses this module created. Each host has its own ``/tmp`` and
``/dev/shm`` (a tmpfs in its own mount namespace, gone with the host), as separate machines do:
what a host's processes leave there stays on that host, and a host that dies takes it along.
MPI is still kept on the network (``UCX_TLS=self,tcp``; see ``NETWORK_ENV``); ``counters``
reads the interfaces' byte counters to prove that it was.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.helpers import live_command_line, stat_fields, task_state

#: Prefix of every name the cluster creates (namespaces, links, files, markers).
PREFIX = "prpy"
HOSTS_FILE = Path("/etc/hosts")
SSH_CONFIG_DIR = Path("/etc/ssh/ssh_config.d")
#: Candidate subnets, tried in order; the first that nothing on this machine uses is taken.
CANDIDATE_SUBNETS = [f"10.{a}.{b}.0/24" for a in (213, 231) for b in range(37, 47)]
#: Keeps MPI traffic on the network between namespaces (and off the machine's /dev/shm, which a
#: job on this machine and a host would share). UCX skips bridge
#: devices unless told, and the root namespace reaches the hosts only through the bridge.
NETWORK_ENV = {"UCX_TLS": "self,tcp", "FI_PROVIDER": "tcp", "UCX_TCP_BRIDGE_ENABLE": "y"}
#: Bound for every command the cluster runs itself.
COMMAND_TIMEOUT = 30


class ClusterUnavailable(Exception):
    """This machine cannot host the cluster (not root, no ``ip``, no sshd, ...); says why."""


def unavailable_reason() -> str | None:
    """Why a cluster cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, a bridge, sshd)"
    for tool in ("ip", "ssh", "ssh-keygen", "unshare"):
        if shutil.which(tool) is None:
            return f"needs '{tool}' on PATH"
    if _sshd() is None:
        return "needs sshd (Debian: openssh-server; `make install` installs it as root)"
    probe = f"{PREFIX}probe{os.getpid()}"
    added = _run(["ip", "netns", "add", probe], check=False)
    if added.returncode:
        return f"'ip netns add' fails: {added.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _sshd() -> str | None:
    return shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/sbin/sshd") if os.access(p, os.X_OK)), None)


def _run(argv: list[str], check: bool = True, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                            check=False)
    if check and result.returncode:
        raise ClusterUnavailable(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class Host:
    """One host of the cluster: its name, network namespace, addresses and sshd.

    ``addresses[n]`` is its address on network n (interface ``ethN``); its name resolves to the
    first, which ssh uses.
    """

    def __init__(self, name: str, namespace: str, addresses: list[str], tag: str, index: int) -> None:
        self.name = name
        self.namespace = namespace
        self.addresses = addresses
        self.veths = [f"{tag}n{n}v{index}" for n in range(len(addresses))]
        self.sshd: subprocess.Popen[bytes] | None = None
        #: Taken off the network since the last test's end (``Cluster.set_link``).
        self.was_cut = False

    @property
    def address(self) -> str:
        return self.addresses[0]

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"


def _parents_first(pids: set[int]) -> list[int]:
    """``pids``, each after its ancestors among them (by the parent pids in /proc)."""
    parent: dict[int, int] = {}
    for pid in pids:
        try:
            parent[pid] = int(stat_fields(f"/proc/{pid}")[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            parent[pid] = 0

    def depth(pid: int) -> int:
        seen = {pid}
        while (pid := parent.get(pid, 0)) in parent and pid not in seen:
            seen.add(pid)
        return len(seen)

    return sorted(pids, key=depth)


def _signal_until(pid: int, sig: int, states: str) -> None:
    """Send ``sig`` to ``pid`` and return once /proc shows it in one of ``states`` (or gone): a
    signal is delivered asynchronously."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + COMMAND_TIMEOUT
    while time.monotonic() < deadline:
        try:
            if task_state(f"/proc/{pid}") in states:
                return
        except (OSError, IndexError):
            return
        time.sleep(0.001)
    name = signal.Signals(sig).name
    raise TimeoutError(f"process {pid} was not in state {states} within {COMMAND_TIMEOUT} s of {name}")


def _freeze(pid: int) -> None:
    """SIGSTOP ``pid``, returning once it is stopped: a process still running could answer what it sees."""
    _signal_until(pid, signal.SIGSTOP, "TtZX")


def _kill_dead(pid: int) -> None:
    """SIGKILL ``pid``, returning once it has exited (a zombie, or gone): its sockets are closed
    then (their FINs sent), before the next process of the host dies."""
    _signal_until(pid, signal.SIGKILL, "ZX")


#: The MPI daemons, which start the instances on a host (Hydra's proxy, Open MPI's prted).
DAEMONS = ("hydra_pmi_proxy", "prted")
#: How long after a host's instances its daemons and sshd die (kill_host): a few kernel ticks.
DAEMONS_AFTER = 0.02


def _started_by_daemons(pids: set[int]) -> set[int]:
    """Those of ``pids`` below one of them that is an MPI daemon (DAEMONS)."""
    parent, daemons = {}, set()
    for pid in pids:
        try:
            parent[pid] = int(stat_fields(f"/proc/{pid}")[1])
            with open(f"/proc/{pid}/comm") as comm:
                if comm.read().strip() in DAEMONS:
                    daemons.add(pid)
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    below = set()
    for pid in pids:
        seen, up = {pid}, parent.get(pid, 0)
        while up in parent and up not in seen:
            if up in daemons:
                below.add(pid)
                break
            seen.add(up)
            up = parent[up]
    return below


class Cluster:
    """``size`` hosts named ``{name_prefix}0..`` on ``networks`` networks (a bridge and a /24
    each); ``start`` builds them, ``stop`` removes all."""

    def __init__(self, size: int, name_prefix: str = "node", networks: int = 1) -> None:
        self.tag = f"{PREFIX}{os.getpid() % 100000}"
        self.size = size
        self.name_prefix = name_prefix
        self.subnets: list[ipaddress.IPv4Network] = []
        self.bridges = [f"{self.tag}n{n}br" for n in range(networks)]
        self.bridge_addresses: list[str] = []
        self.hosts: list[Host] = []
        # Not under /tmp, which every host replaces with its own: its sshd reads its keys from here.
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/run" if os.access("/run", os.W_OK) else None))
        self.ssh_config = SSH_CONFIG_DIR / f"{self.tag}.conf"
        self.marker = f"# {PREFIX} test cluster {self.tag} (pid {os.getpid()})"

    # ------------------------------------------------------------------ build
    def start(self) -> Cluster:
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        remove_stale()
        try:
            self.subnets = _free_subnets(len(self.bridges))
            self.bridge_addresses = [str(net[1]) for net in self.subnets]
            self.hosts = [Host(f"{self.name_prefix}{i}", f"{self.tag}-{self.name_prefix}{i}",
                               [str(net[11 + i]) for net in self.subnets], self.tag, i) for i in range(self.size)]
            self._keys()
            self._network()
            self._names()
            for host in self.hosts:
                self.start_sshd(host)
            self._wait_for_ssh()
        except BaseException:
            self.stop()
            raise
        return self

    def _keys(self) -> None:
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.workdir / "id_ed25519")])
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.workdir / "host_ed25519")])
        shutil.copy(self.workdir / "id_ed25519.pub", self.workdir / "authorized_keys")
        host_key = (self.workdir / "host_ed25519.pub").read_text().split()[:2]
        known = [f"{h.name},{h.address} {' '.join(host_key)}" for h in self.hosts]
        (self.workdir / "known_hosts").write_text("\n".join(known) + "\n")
        os.chmod(self.workdir, 0o700)

    def _network(self) -> None:
        for bridge, address, subnet in zip(self.bridges, self.bridge_addresses, self.subnets, strict=True):
            _run(["ip", "link", "add", bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{address}/{subnet.prefixlen}", "dev", bridge])
            _run(["ip", "link", "set", bridge, "up"])
        for host in self.hosts:
            _run(["ip", "netns", "add", host.namespace])
            inside = ["ip", "netns", "exec", host.namespace]
            _run([*inside, "ip", "link", "set", "lo", "up"])
            for n, (bridge, subnet) in enumerate(zip(self.bridges, self.subnets, strict=True)):
                veth, interface = host.veths[n], f"eth{n}"
                _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", interface, "netns", host.namespace])
                _run(["ip", "link", "set", veth, "master", bridge, "up"])
                _run([*inside, "ip", "addr", "add", f"{host.addresses[n]}/{subnet.prefixlen}", "dev", interface])
                _run([*inside, "ip", "link", "set", interface, "up"])

    def _names(self) -> None:
        block = [self.marker, *(f"{h.address} {h.name}" for h in self.hosts), f"{self.marker} end"]
        text = HOSTS_FILE.read_text()
        HOSTS_FILE.write_text(text + ("" if text.endswith("\n") or not text else "\n") + "\n".join(block) + "\n")
        names = " ".join(h.name for h in self.hosts) + " " + " ".join(h.address for h in self.hosts)
        self.ssh_config.write_text(
            f"{self.marker}\n"
            f"Host {names}\n"
            f"  User root\n"
            f"  IdentityFile {self.workdir / 'id_ed25519'}\n"
            f"  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {self.workdir / 'known_hosts'}\n"
            f"  StrictHostKeyChecking yes\n"
            f"  BatchMode yes\n"
            f"  ConnectTimeout 5\n"
            f"  LogLevel ERROR\n"
        )

    def _sshd_config(self, host: Host) -> Path:
        path = self.workdir / f"sshd_{host.name}.conf"
        path.write_text(
            f"ListenAddress {host.address}\n"
            "Port 22\n"
            f"HostKey {self.workdir / 'host_ed25519'}\n"
            f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}\n"
            f"PidFile none\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "MaxStartups 200\n"
            "MaxSessions 200\n"
            "LogLevel ERROR\n"
        )
        return path

    def start_sshd(self, host: Host) -> None:
        """Start (or restart) the host's sshd, in the host's namespaces, with its hostname set."""
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        config = self._sshd_config(host)
        private = " && ".join(f"mount -t tmpfs -o mode=1777,size=1g {host.namespace} {where}"
                              for where in ("/tmp", "/dev/shm"))
        script = f"{private} && hostname {host.name} && exec {_sshd()} -D -e -f {config}"
        host.sshd = subprocess.Popen(["ip", "netns", "exec", host.namespace, "unshare", "--uts", "--mount",
                                      "--propagation", "private", "--", "sh", "-c", script],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def _wait_for_ssh(self, within: float = 20.0) -> None:
        for host in self.hosts:
            deadline = time.monotonic() + within
            while True:
                result = self.ssh(host, "hostname", check=False)
                if result.returncode == 0 and result.stdout.strip() == host.name:
                    break
                if time.monotonic() > deadline or (host.sshd is not None and host.sshd.poll() is not None):
                    err = host.sshd.stderr.read().decode() if host.sshd and host.sshd.poll() is not None \
                        and host.sshd.stderr else ""
                    raise ClusterUnavailable(f"sshd on {host.name} does not answer: {result.stderr.strip()} {err}")
                time.sleep(0.1)

    # ------------------------------------------------------------------ use
    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def ssh(self, host: Host, command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(["ssh", host.name, command], check=check)

    def pids(self, host: Host) -> list[int]:
        """Every process whose network namespace is the host's."""
        out = _run(["ip", "netns", "pids", host.namespace], check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def processes(self, host: Host, include_sshd: bool = False) -> list[str]:
        """Command lines of the host's live processes (its listening sshd left out unless asked)."""
        keep = []
        for pid in self.pids(host):
            if not include_sshd and host.sshd is not None and pid == host.sshd.pid:
                continue
            cmdline = live_command_line(pid)
            if cmdline is not None:
                keep.append(f"{pid}: {cmdline}")
        return keep

    def leftovers(self, within: float = 5.0) -> dict[str, list[str]]:
        """Processes still running on any host (sshd aside) after up to ``within`` seconds."""
        deadline = time.monotonic() + within
        while True:
            left = {h.name: self.processes(h) for h in self.hosts}
            left = {name: procs for name, procs in left.items() if procs}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def kill_host(self, host: Host) -> None:
        """The host dies: every one of its processes, sshd included, is SIGKILLed at once.

        A real host dies at one instant; killing its processes one by one would let a survivor
        see a sibling's death and answer (a stub reporting its program's exit), so every process
        is first frozen with SIGSTOP (again until no new one appears), then killed. Parents are
        frozen before their children, each seen stopped before the next: a parent still running
        when its child stops would see that and answer (a stub reporting its program stopped).
        Children are killed before their parents: a parent's death would orphan its children's
        process group, and the kernel continues an orphaned group's stopped members (SIGHUP, then
        SIGCONT), which could then see the death and answer.

        What the MPI daemon started (the stubs and their programs) dies first, each seen dead
        before the next is killed, and the daemons and sshd only DAEMONS_AFTER later. Killed all
        at once, the host's sshd could go first on a busy machine: its launcher then ends the
        other hosts' instances within milliseconds, and poprun, which orders the connections that
        ended by their last segment's kernel time (jiffies: 4 ms at HZ=250), could find another
        host's end first (a known limit of per-instance connections; see docs/design.md)."""
        frozen: set[int] = set()
        while fresh := set(self.pids(host)) - frozen:
            for pid in _parents_first(fresh):
                _freeze(pid)
            frozen |= fresh
        order = list(reversed(_parents_first(frozen)))
        started = _started_by_daemons(frozen)
        for pid in [p for p in order if p in started]:
            _kill_dead(pid)
        if started:
            time.sleep(DAEMONS_AFTER)
        for pid in [p for p in order if p not in started]:
            _kill_dead(pid)
        if host.sshd is not None:
            host.sshd.wait(timeout=COMMAND_TIMEOUT)
            host.sshd = None

    def stop_sshd(self, host: Host) -> None:
        """Only the host's sshd goes down (connections are then refused)."""
        if host.sshd is not None:
            host.sshd.kill()
            host.sshd.wait(timeout=COMMAND_TIMEOUT)
            host.sshd = None

    def set_link(self, host: Host, up: bool) -> None:
        """Take the host off every network (nothing answers, not even a refusal) or back on."""
        host.was_cut = host.was_cut or not up
        for n in range(len(self.bridges)):
            _run(["ip", "netns", "exec", host.namespace, "ip", "link", "set", f"eth{n}", "up" if up else "down"])

    def restore(self, host: Host) -> None:
        """Bring a killed host (or its sshd) back."""
        if host.sshd is None:
            self.start_sshd(host)
            self._wait_for_ssh()

    def counters(self, host: Host, network: int = 0) -> tuple[int, int]:
        """(received, sent) bytes of the host's interface on ``network``."""
        folder = f"/sys/class/net/eth{network}/statistics"
        out = _run(["ip", "netns", "exec", host.namespace, "cat", f"{folder}/rx_bytes", f"{folder}/tx_bytes"]).stdout
        received, sent = out.split()
        return int(received), int(sent)

    # ------------------------------------------------------------------ remove
    def stop(self) -> None:
        for host in self.hosts:
            self.kill_host(host)
        for host in self.hosts:
            _run(["ip", "netns", "del", host.namespace], check=False)
        for bridge in self.bridges:
            _run(["ip", "link", "del", bridge], check=False)
        _remove_hosts_block(self.marker)
        self.ssh_config.unlink(missing_ok=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _free_subnets(count: int) -> list[ipaddress.IPv4Network]:
    """The first ``count`` candidate /24s that no address or route of this machine touches."""
    used = []
    for entry in json.loads(_run(["ip", "-j", "-4", "addr"]).stdout or "[]"):
        for info in entry.get("addr_info", []):
            used.append(ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", strict=False))
    for route in json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            try:
                used.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
            except ValueError:
                continue
    free = [net for net in map(ipaddress.IPv4Network, CANDIDATE_SUBNETS) if not any(net.overlaps(u) for u in used)]
    if len(free) >= count:
        return free[:count]
    raise ClusterUnavailable(f"every candidate subnet ({CANDIDATE_SUBNETS[0]} ...) is in use on this machine")


def _remove_hosts_block(marker: str) -> None:
    lines = HOSTS_FILE.read_text().splitlines(keepends=True)
    kept, inside = [], False
    for line in lines:
        if line.rstrip("\n") == marker:
            inside = True
            continue
        if inside:
            if line.rstrip("\n") == f"{marker} end":
                inside = False
            continue
        kept.append(line)
    if len(kept) != len(lines):
        HOSTS_FILE.write_text("".join(kept))


def remove_stale() -> None:
    """Remove what a cluster whose process is gone left behind (a crashed or killed run)."""
    for line in HOSTS_FILE.read_text().splitlines():
        if line.startswith(f"# {PREFIX} test cluster ") and line.endswith(")"):
            pid = int(line.rsplit("pid ", 1)[1].rstrip(")"))
            if not _alive(pid):
                _remove_hosts_block(line)
    for path in SSH_CONFIG_DIR.glob(f"{PREFIX}*.conf"):
        first = path.read_text().split("\n", 1)[0]
        if "pid " in first and not _alive(int(first.rsplit("pid ", 1)[1].rstrip(")"))):
            path.unlink(missing_ok=True)
    live_tags = {f"{PREFIX}{pid % 100000}" for pid in _live_cluster_pids()}
    for name in _run(["ip", "netns", "list"], check=False).stdout.split():
        if name.startswith(PREFIX) and name.split("-", 1)[0] not in live_tags:
            for text in _run(["ip", "netns", "pids", name], check=False).stdout.split():
                try:
                    os.kill(int(text), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", name], check=False)
    for link in json.loads(_run(["ip", "-j", "link"], check=False).stdout or "[]"):
        name = link.get("ifname", "")
        if name.startswith(PREFIX) and name.endswith("br") and name.split("n", 1)[0] not in live_tags:
            _run(["ip", "link", "del", name], check=False)


def _live_cluster_pids() -> list[int]:
    pids = []
    for line in HOSTS_FILE.read_text().splitlines():
        if line.startswith(f"# {PREFIX} test cluster ") and line.endswith(")"):
            pid = int(line.rsplit("pid ", 1)[1].rstrip(")"))
            if _alive(pid):
                pids.append(pid)
    return pids
