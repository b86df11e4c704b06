"""The pieces of a multi-host launch that need no hosts: addresses, launcher messages, and the
dry run of a job too large for one command line. No name is sent to a DNS server."""

from __future__ import annotations

import socket

import pytest

from poprun_py.planning.mpi import MAX_COMMAND_BYTES, OPENMPI_APP_LINE
from poprun_py.shared.errors import PlanError
from poprun_py.shared.network import address_in_subnet, callback_address, is_local_name, local_addresses, remote_hosts
from poprun_py.supervision.host_errors import describe, host_failures, launcher_text
from tests.helpers import OPENMPI_MPIEXEC, poprun


def test_loopback_is_found_by_subnet() -> None:
    assert local_addresses()["127.0.0.1"] == "lo"
    assert address_in_subnet("127.0.0.0/8") == ("127.0.0.1", "lo")
    assert callback_address([], "127.0.0.0/8") == "127.0.0.1"


def test_subnet_errors_name_the_value() -> None:
    with pytest.raises(PlanError, match=r"--host-subnet '10.0.0.0/99' is not an IPv4 network in CIDR form"):
        address_in_subnet("10.0.0.0/99")
    with pytest.raises(PlanError, match=r"--host-subnet 10.254.253.0/24: no local interface has an address in it; "
                                        r"local addresses: .*127.0.0.1 \(lo\)"):
        address_in_subnet("10.254.253.0/24")


def test_local_names_are_known_without_a_resolver() -> None:
    for name in ("localhost", "127.0.0.1", "127.4.5.6", "::1", socket.gethostname()):
        assert is_local_name(name), name
    assert not is_local_name("node7")
    assert remote_hosts(["localhost", "node7", "node8"], resolve=False) == ["node7", "node8"]
    # Resolved: a name that is this machine's address counts as local; after the first remote host,
    # names are judged without a look-up (malformed names: the C library asks no DNS server).
    assert remote_hosts(["127.0.0.2", "ghost!a", "127.0.0.3", "ghost!b"]) == ["ghost!a", "ghost!b"]
    assert callback_address([], None) is None  # one host: loopback


HYDRA_UNKNOWN = """ssh: Could not resolve hostname nodex: Name or service not known
[mpiexec@vm] ui_cmd_cb (/mpich-5.0.2/src/pm/hydra/mpiexec/pmiserv_pmci.c:51): Launch proxy failed.
[mpiexec@vm] main (/mpich-5.0.2/src/pm/hydra/mpiexec/mpiexec.c:270): process manager error waiting for completion
"""
OPENMPI_DAEMON = """------------------------------------------------------------
A daemon failed to report back after being spawned.

  Local host:    vm
  Remote host:   node1
  Daemon exit status: 255

This may also be caused by a firewall on the remote host.
------------------------------------------------------------
"""


def test_launcher_output_is_read_into_one_line_per_host() -> None:
    hosts = ["node0", "nodeX", "node1"]
    assert host_failures(HYDRA_UNKNOWN, hosts) == {
        "nodeX": "ssh: Could not resolve hostname nodex: Name or service not known"}  # ssh lower-cases names
    refused = "ssh: connect to host node1 port 22: Connection refused\n"
    assert host_failures(refused + OPENMPI_DAEMON, hosts) == {
        "node1": "ssh: connect to host node1 port 22: Connection refused"}  # ssh's own words first
    assert host_failures(OPENMPI_DAEMON, hosts) == {
        "node1": "Open MPI's daemon there did not call back (exit status 255)"}
    assert host_failures("root@node0: Permission denied (publickey).\n", hosts) == {
        "node0": "root@node0: Permission denied (publickey)."}
    assert host_failures("Connection to node1 closed by remote host.\n", hosts) == {
        "node1": "Connection to node1 closed by remote host."}
    assert host_failures("ssh: connect to host other port 22: Connection refused\n", hosts) == {}
    assert describe({"a": "x", "b": "y"}) == "host a: x; host b: y"


@pytest.mark.slow  # starts poprun
def test_dry_run_of_4096_instances_on_1024_hosts_is_readable() -> None:
    result = poprun("--dry-run", "--num-instances", "4096", "--print-topology", "yes", "-H", "n[0000-1023]",
                    "python", "train.py", "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(result.stdout) < 8000 and max(map(len, lines)) < 1000
    assert lines[0] == "poprun topology: 1024 host(s) x 4 instance(s) x 1 replica(s) = 4096 replicas"
    assert "  n1023: instances 4092-4095, replicas 4092-4095" in lines
    command = next(line for line in lines if line.startswith("command: "))
    assert " -f '<host-file>' " in command and command.endswith("-configfile '<config-file>'")
    assert "<config-file>: 4096 lines (the command line would be too long)" in lines
    assert "<host-file>: 1024 lines (the command line would be too long)" in lines
    assert "  n0000:4" in lines and "  ... 4090 more ..." in lines
    # The program is in no file: the stubs get it from poprun.
    assert "train.py" not in command and "  ... train.py" not in result.stdout
    assert "program: python train.py --lr 0.1" in lines


@pytest.mark.slow  # starts poprun
def test_local_args_with_spaces_cannot_go_in_a_config_file() -> None:
    result = poprun("--dry-run", "--num-instances", "2048", "--mpi-local-args", "-env A 'two words'", "/bin/true")
    assert result.returncode == 2
    assert result.stderr == ("poprun: error: 'two words' cannot go in mpiexec's config file, which a job this "
                             "large needs (its lines are split at white space, without quoting); use arguments "
                             "without spaces or quotes in --mpi-local-args / --instance-mpi-local-args\n")


@pytest.mark.slow  # starts poprun
def test_an_app_context_longer_than_open_mpi_reads_of_a_line_cannot_go_in_its_app_file() -> None:
    """Open MPI 5's prterun reads a line of its app file in 1024 bytes (newline and NUL included):
    a longer line was cut in two, and the job never started or prterun crashed. 1022 bytes pass."""
    def dry_run(value: str) -> tuple[int, list[str], str]:
        result = poprun("--dry-run", "--mpi", str(OPENMPI_MPIEXEC), "--num-instances", "2",
                        "--mpi-global-args", f"-x PADDING={'x' * MAX_COMMAND_BYTES}",
                        "--instance-mpi-local-args", f"1:-x LONG={value}", "/bin/true")
        lines = [line[2:] for line in result.stdout.splitlines() if " -x LONG=" in line]
        return result.returncode, lines, result.stderr

    _, [line], _ = dry_run("")
    fits = "y" * (OPENMPI_APP_LINE - len(line))
    status, [line], _ = dry_run(fits)
    assert status == 0 and len(line) == OPENMPI_APP_LINE
    refused = (f"poprun: error: an instance's app context is {OPENMPI_APP_LINE + 1} bytes, and Open MPI reads at "
               f"most {OPENMPI_APP_LINE} of a line of its app file, which a job this large needs; shorten "
               "--mpi-local-args / --instance-mpi-local-args\n")
    assert dry_run(fits + "y") == (2, [], refused)


def test_launcher_output_in_another_encoding_is_read_not_refused() -> None:
    # ssh's message translated in a Latin-1 locale: the name's byte 0xf6 is not UTF-8.
    output = launcher_text([b"ssh: Could not resolve hostname n\xf6de9: ", b"Name or service not known\n"])
    assert output == "ssh: Could not resolve hostname n\ufffdde9: Name or service not known\n"
    assert host_failures(output, ["node0"]) == {}
