"""What a host's supervisor takes from its environment before its stubs start their programs: the
kill grace (``POPRUN_KILL_GRACE``), the silence limit (``POPRUN_SILENCE_LIMIT``) and, with
``--host-subnet``, the network interface MPI is kept on (``HostPrograms``)."""

from __future__ import annotations

import ipaddress
import os

import pytest

from popcontract import environment
from poprun_py.host.link import kill_grace, silence_limit
from poprun_py.host.programs import HostPrograms
from poprun_py.planning.mpi import daemon_keepalive, ssh_args
from poprun_py.shared.cores import threads_per_instance
from poprun_py.shared.network import local_addresses
from poprun_py.wire.protocol import bad_grace, grace_seconds, heartbeat_seconds
from tests.helpers import MPICH_MPIEXEC, poprun


@pytest.mark.parametrize("text, seconds", [("0", 0.0), ("2.5", 2.5), ("30", 30.0), ("1e3", 1000.0)])
def test_a_kill_grace_is_a_finite_number_of_seconds_from_zero(text: str, seconds: float) -> None:
    assert grace_seconds(text) == seconds


@pytest.mark.parametrize("text", ["abc", "-1", "-0.001", "nan", "inf", "", " "])
def test_anything_else_is_not_a_kill_grace(text: str) -> None:
    assert grace_seconds(text) is None


def test_a_long_bad_grace_is_shown_cut_to_40_characters() -> None:
    name = environment.KILL_GRACE
    assert bad_grace("x" * 40) == f"{name}={'x' * 40!r} is not a number of seconds (>= 0)"
    assert bad_grace("x" * 41) == f"{name}={'x' * 40 + '...'!r} is not a number of seconds (>= 0)"


@pytest.mark.slow  # starts poprun
@pytest.mark.parametrize("grace", ["abc", "-1", "nan", ""])
def test_a_bad_kill_grace_is_one_line_before_anything_starts(grace: str, monkeypatch: pytest.MonkeyPatch,
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    result = poprun("/bin/true", env={environment.KILL_GRACE: grace})
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"poprun: error: {environment.KILL_GRACE}={grace!r} is not a number of seconds (>= 0)\n"
    # A host's supervisor that still gets such a value (started by hand) warns once and uses the default.
    monkeypatch.setenv(environment.KILL_GRACE, grace)
    assert kill_grace() == 3.0
    assert capfd.readouterr().err == (f"poprun: warning: {environment.KILL_GRACE}={grace!r} is not a number of "
                                      "seconds (>= 0); using 3\n")


def test_a_good_kill_grace_reaches_a_hosts_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(environment.KILL_GRACE, "0.5")
    assert kill_grace() == 0.5


@pytest.mark.slow  # starts poprun
@pytest.mark.parametrize("limit", ["abc", "0", "-1", "nan", "4.9"])
def test_a_bad_silence_limit_is_one_line_before_anything_starts(limit: str, monkeypatch: pytest.MonkeyPatch,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    result = poprun("/bin/true", env={environment.SILENCE_LIMIT: limit})
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"poprun: error: {environment.SILENCE_LIMIT}={limit!r} ")
    assert result.stderr.endswith("or inf)\n") and result.stderr.count("\n") == 1, result.stderr
    # A host's supervisor that still gets such a value (started by hand) warns once and uses the default.
    monkeypatch.setenv(environment.SILENCE_LIMIT, limit)
    assert silence_limit() == 20.0
    said = capfd.readouterr().err
    assert said.startswith(f"poprun: warning: {environment.SILENCE_LIMIT}={limit!r} ") and said.endswith("; using 20\n")


@pytest.mark.parametrize("text, seconds", [("", 20.0), ("8", 8.0), ("300", 300.0), ("inf", float("inf"))])
def test_a_silence_limit_reaches_a_hosts_supervisor(text: str, seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(environment.SILENCE_LIMIT, text)
    assert silence_limit() == seconds


@pytest.mark.parametrize("limit, beat, ssh, keepalive", [
    (20.0, 5.0, "-o ConnectTimeout=10 -o BatchMode=yes -o ServerAliveInterval=5 -o ServerAliveCountMax=3", 2),
    (300.0, 5.0, "-o ConnectTimeout=150 -o BatchMode=yes -o ServerAliveInterval=5 -o ServerAliveCountMax=3", 2),
    (8.0, 2.0, "-o ConnectTimeout=4 -o BatchMode=yes -o ServerAliveInterval=2 -o ServerAliveCountMax=3", 1),
    (5.0, 1.25, "-o ConnectTimeout=2 -o BatchMode=yes -o ServerAliveInterval=1 -o ServerAliveCountMax=3", 1),
    (float("inf"), 5.0, "-o BatchMode=yes -o ServerAliveInterval=5 -o ServerAliveCountMax=3", 2),
])
def test_the_silence_limit_bounds_every_wait_for_a_host(limit: float, beat: float, ssh: str, keepalive: int) -> None:
    """Hosts' supervisors say something every quarter of the limit (at least every 5 s); ssh gives a host half
    the limit to answer; Open MPI's daemons give up on their launcher (3 probes) well within it."""
    assert heartbeat_seconds(limit) == beat
    assert ssh_args(limit) == ssh
    assert daemon_keepalive(limit) == keepalive and keepalive * 4 < limit


@pytest.mark.slow  # starts poprun
def test_the_silence_limit_reaches_the_ssh_options_of_a_job() -> None:
    result = poprun("--dry-run", "--num-instances", "2", "-H", "node0,node1", "--mpi", str(MPICH_MPIEXEC), "/bin/true",
                    env={environment.SILENCE_LIMIT: "8"})
    assert result.returncode == 0, result.stderr
    assert "environment: HYDRA_LAUNCHER_EXTRA_ARGS='-o ConnectTimeout=4 -o BatchMode=yes" in result.stdout


def loopback() -> str:
    """This host's loopback interface (named by the kernel, not assumed)."""
    return next(interface for address, interface in local_addresses().items() if address.startswith("127."))


def _pinned(subnet: str, launch_env: dict[str, str]) -> dict[str, str | None]:
    """What --host-subnet ``subnet`` changes of MPI's interface in an instance's environment."""
    changes, _ = HostPrograms(1, None, one_stream=False, subnet=subnet).environment(0, launch_env)
    names = (environment.UCX_NET_DEVICES, environment.FI_TCP_IFACE)
    return {name: None if value is None else os.fsdecode(value)
            for name in names if (value := changes.get(os.fsencode(name), b"")) != b""}


def test_host_subnet_pins_mpi_to_the_interface_with_an_address_in_it() -> None:
    assert _pinned("127.0.0.0/8", {}) == {environment.UCX_NET_DEVICES: loopback(), environment.FI_TCP_IFACE: loopback()}


def test_host_subnet_leaves_the_users_own_choice() -> None:
    assert _pinned("127.0.0.0/8", {environment.UCX_NET_DEVICES: "mine0", environment.FI_TCP_IFACE: "mine1"}) == {}


def test_a_subnet_with_no_interface_here_is_a_warning_and_pins_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    here = local_addresses()
    # A documentation network (RFC 5737) that no interface of this host is on (some hosts use one).
    subnet = next(net for net in ("198.51.100.0/24", "203.0.113.0/24", "192.0.2.0/24")
                  if not any(ipaddress.ip_address(a) in ipaddress.ip_network(net) for a in here))
    assert _pinned(subnet, {}) == {}
    shown = ", ".join(f"{a} ({i})" for a, i in sorted(here.items()))
    assert capfd.readouterr().err == (f"poprun: warning: on host {os.uname().nodename}: --host-subnet {subnet}: "
                                      f"no local interface has an address in it; local addresses: {shown}\n")


def test_each_instance_gets_its_share_of_this_hosts_usable_cores_and_at_least_one() -> None:
    cores = len(os.sched_getaffinity(0))
    assert threads_per_instance(1) == cores
    assert threads_per_instance(cores) == 1
    assert threads_per_instance(2 * cores) == 1  # more instances than cores: one thread each, not none
