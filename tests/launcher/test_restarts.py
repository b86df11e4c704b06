"""Where a restart runs (``poprun_py.supervision.restarts``): the same replicas spread over the hosts left,
failed hosts left out for a cooldown that doubles, the discovery script's contract, the backoff."""

from __future__ import annotations

from pathlib import Path

import pytest

from poprun_py.shared.errors import PlanError
from poprun_py.supervision.restarts import (
    MAX_BACKOFF,
    MAX_COOLDOWN,
    HostPool,
    Layout,
    Restarts,
    backoff,
    discover,
    parse_discovered,
    spread,
)
from tests.helpers import PYTHON, poprun


@pytest.mark.parametrize("replicas,per_host,hosts,slots,expected", [
    # The case: 6 replicas, 3 hosts x 1 instance (2 replicas each); node2 lost: 2 x 1 (3 each).
    (6, 1, ["node0", "node1"], {}, (2, ["node0", "node1"])),
    # Instances per host kept when the replicas allow: 8 replicas, 2 per host on 4 hosts, 2 left.
    (8, 2, ["a", "b"], {}, (4, ["a", "b"])),
    # ... else the nearest that divides a host's replicas: 12 on 3 hosts left is 4 each; 3 per host
    # does not divide 4, so 2 (nearer than 4; on a tie the fewer).
    (12, 3, ["a", "b", "c"], {}, (6, ["a", "b", "c"])),
    (12, 3, ["a", "b"], {}, (6, ["a", "b"])),  # 6 each: 3 per host divides it
    # Replicas that do not spread over every host left: the most hosts they spread over, in order.
    (6, 1, ["a", "b", "c", "d"], {}, (3, ["a", "b", "c"])),
    (7, 1, ["a", "b", "c"], {}, (1, ["a"])),
    # slots bound the instances a host takes (the fewest slots among the hosts used).
    (8, 4, ["a", "b"], {"b": 2}, (4, ["a", "b"])),
    (8, 4, ["a", "b"], {"a": 1, "b": 2}, (2, ["a", "b"])),
])
def test_the_replicas_spread_over_the_hosts_left(replicas: int, per_host: int, hosts: list[str],
                                                   slots: dict[str, int], expected: tuple[int, list[str]]) -> None:
    assert spread(replicas, per_host, hosts, slots) == expected


def test_every_spread_keeps_every_replica_and_even_instances() -> None:
    for replicas in range(1, 49):
        for per_host in range(1, 5):
            for count in range(1, 7):
                instances, used = spread(replicas, per_host, [f"h{i}" for i in range(count)], {})
                assert replicas % instances == 0 and instances % len(used) == 0
                assert len(used) == max(n for n in range(1, count + 1) if replicas % n == 0)


def test_a_failed_host_is_left_out_for_its_cooldown_doubled_with_each_failure() -> None:
    pool = HostPool(["a", "b", "c"], cooldown=10)
    assert pool.failed("b", now=100) == 10
    assert pool.usable(now=109.9) == ["a", "c"] and pool.cooling(now=109.9) == pytest.approx({"b": 0.1})
    assert pool.usable(now=110) == ["a", "b", "c"]
    assert pool.failed("b", now=200) == 20 and pool.usable(now=219) == ["a", "c"]
    for _ in range(20):
        pool.failed("b", now=300)
    assert pool.until["b"] == 300 + MAX_COOLDOWN


def test_discovered_hosts_replace_the_known_ones_up_to_the_job_s_first_size() -> None:
    pool = HostPool(["a", "b"], cooldown=10)
    pool.failed("a", now=0)
    pool.discovered([("c", 4), ("a", None), ("d", None)])
    assert pool.usable(now=1) == ["c", "d"]  # a still cools down; two hosts at most
    assert pool.usable(now=11) == ["c", "a"] and pool.slots == {"c": 4}


@pytest.mark.parametrize("text,expected", [
    ("node0\nnode1:4\n", [("node0", None), ("node1", 4)]),
    ("# from the scheduler\n\n node0 \nnode1:2  # two free\n", [("node0", None), ("node1", 2)]),
    ("", []),
])
def test_the_discovery_contract_is_host_or_host_colon_slots(text: str, expected: list[tuple[str, int | None]]) -> None:
    assert parse_discovered(text, "find-hosts") == expected


@pytest.mark.parametrize("text,said", [
    ("node0:x\n", ("--host-discovery-script find-hosts printed 'node0:x' on line 1; each line is 'host' or "
                   "'host:slots' with slots a whole number from 1")),
    ("a\nnode0:0\n", "printed 'node0:0' on line 2"),
    ("node0\nnode0:2\n", "lists the host 'node0' twice"),
])
def test_a_bad_discovery_line_is_one_line_naming_it(text: str, said: str) -> None:
    with pytest.raises(PlanError) as raised:
        parse_discovered(text, "find-hosts")
    assert said in str(raised.value) and "\n" not in str(raised.value)


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "find-hosts"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.slow  # starts the discovery script
@pytest.mark.parametrize("body,said", [
    ("echo broken >&2; exit 4", "find-hosts exited with status 4 (broken)"),
    ("true", "find-hosts listed no hosts"),
    ("echo 'node0:many'", "find-hosts printed 'node0:many' on line 1"),
])
def test_a_discovery_script_that_fails_is_one_line_saying_how(tmp_path: Path, body: str, said: str) -> None:
    with pytest.raises(PlanError) as raised:
        discover(_script(tmp_path, body))
    assert str(raised.value).startswith("--host-discovery-script ") and said in str(raised.value)


@pytest.mark.slow  # starts the discovery script
def test_a_discovery_script_that_cannot_run_or_hangs_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PlanError, match=r"missing cannot run: No such file or directory$"):
        discover(str(tmp_path / "missing"))
    monkeypatch.setattr("poprun_py.supervision.restarts.DISCOVERY_TIMEOUT", 0.2)
    with pytest.raises(PlanError, match=r"find-hosts took longer than 0 s$"):
        discover(_script(tmp_path, "exec sleep 30"))


@pytest.mark.slow  # starts the discovery script
def test_at_a_restart_a_failed_discovery_keeps_the_hosts_known(tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    script = _script(tmp_path, "exit 3")
    restarts = Restarts(Layout(2, ["a", "b"]), 4, min_hosts=1, cooldown=60, discovery_script=script)
    assert restarts.next_layout(Layout(2, ["a", "b"]), {"b": "lost"}, now=0)[0] == Layout(1, ["a"])
    assert capfd.readouterr().err.endswith(f"--host-discovery-script {script} exited with status 3: keeping the "
                                           "hosts known before\n")
    (tmp_path / "find-hosts").write_text("#!/bin/sh\necho c:1; echo b; echo a\n")
    layout, said = restarts.next_layout(Layout(1, ["a"]), {}, now=1)  # b still cools down; c joins, 1 slot
    assert layout == Layout(2, ["c", "a"]) and said.startswith("the restart runs on 2 host(s) with c (discovered)")


def test_the_backoff_doubles_up_to_its_bound() -> None:
    assert [backoff(n, 1) for n in (1, 2, 3, 4)] == [1, 2, 4, 8]
    assert backoff(30, 1) == MAX_BACKOFF and backoff(3, 0) == 0


def test_a_lost_host_is_left_out_and_the_change_said_in_one_line() -> None:
    restarts = Restarts(Layout(3, ["node0", "node1", "node2"]), 6, min_hosts=1, cooldown=60, discovery_script=None)
    layout, said = restarts.next_layout(Layout(3, ["node0", "node1", "node2"]), {"node2": "ssh: gone"}, now=0)
    assert layout == Layout(2, ["node0", "node1"])
    assert said == ("the restart runs on 2 host(s) without node2 (lost, tried again in 60 s): 2 instance(s) x 3 "
                    "local replica(s) = 6 replicas (before: 3 x 2 on 3 host(s))")
    # Nothing lost this time: the same layout, nothing to say; once node2 has cooled down, it is back.
    assert restarts.next_layout(layout, {}, now=30) == (layout, "")
    layout, said = restarts.next_layout(layout, {}, now=60)
    assert layout == Layout(3, ["node0", "node1", "node2"])
    assert said.startswith("the restart runs on 3 host(s) with node2 again: 3 instance(s) x 2 local replica(s)")


def test_fewer_hosts_than_min_hosts_stops_saying_why() -> None:
    restarts = Restarts(Layout(4, ["a", "b"]), 8, min_hosts=2, cooldown=60, discovery_script=None)
    with pytest.raises(PlanError) as raised:
        restarts.next_layout(Layout(4, ["a", "b"]), {"b": "lost"}, now=0)
    assert str(raised.value) == ("not restarting: 1 host(s) left (a), fewer than --min-hosts 2; left out after "
                                 "failing: b for 60 s")


def test_a_job_on_this_machine_only_restarts_as_it_was() -> None:
    restarts = Restarts(Layout(2, []), 4, min_hosts=1, cooldown=60, discovery_script=None)
    assert restarts.next_layout(Layout(2, []), {}, now=0) == (Layout(2, []), "")


@pytest.mark.slow  # starts poprun
def test_without_hosts_the_first_start_asks_the_discovery_script(tmp_path: Path) -> None:
    found = poprun("--host-discovery-script", _script(tmp_path, "echo nodeA; echo nodeB:2"), "--num-instances", "2",
                   "--dry-run", "/bin/true")
    assert found.returncode == 0, found.stderr
    assert "  instance 0 on nodeA (local index 0): replicas 0\n  instance 1 on nodeB (local index 0): replicas 1\n" \
        in found.stdout
    failing = _script(tmp_path, "exit 2")
    refused = poprun("--host-discovery-script", failing, "--num-instances", "2", "--dry-run", "/bin/true")
    assert (refused.returncode, refused.stderr) == (2, (f"poprun: error: --host-discovery-script {failing} exited "
                                                       "with status 2\n"))


@pytest.mark.slow  # starts poprun
def test_the_first_start_fits_the_slots_the_discovery_script_gives(tmp_path: Path) -> None:
    """4 instances on 2 hosts put 2 on each: a host given 1 slot is named; 2 slots (or none said) start."""
    script = _script(tmp_path, "echo nodeA:1; echo nodeB:2")
    short = poprun("--host-discovery-script", script, "--num-instances", "4", "--dry-run", "/bin/true")
    assert (short.returncode, short.stderr) == (2, (
        f"poprun: error: --host-discovery-script {script} gives nodeA:1: fewer slots than the 2 instances per "
        "host that 4 instances on 2 hosts need\n"))
    fits = poprun("--host-discovery-script", _script(tmp_path, "echo nodeA:2; echo nodeB"), "--num-instances", "4",
                  "--dry-run", "/bin/true")
    assert fits.returncode == 0, fits.stderr
    assert "  instance 1 on nodeA (local index 1)" in fits.stdout, fits.stdout
    assert "  instance 3 on nodeB (local index 1)" in fits.stdout, fits.stdout


def test_a_host_left_idle_and_used_later_is_neither_back_nor_discovered() -> None:
    """6 replicas on 6 hosts; 2 lost: 3 of the 4 left take them, f is idle; one more lost: f is used."""
    hosts = ["a", "b", "c", "d", "e", "f"]
    restarts = Restarts(Layout(6, hosts), 6, min_hosts=1, cooldown=60, discovery_script=None)
    layout, said = restarts.next_layout(Layout(6, hosts), {"a": "lost", "b": "lost"}, now=0)
    assert layout == Layout(3, ["c", "d", "e"]) and "f idle (6 replicas do not spread evenly over 4 hosts)" in said
    layout, said = restarts.next_layout(layout, {"c": "lost"}, now=1)
    assert layout == Layout(3, ["d", "e", "f"])
    assert said.startswith("the restart runs on 3 host(s) without c (lost, tried again in 60 s), with f: ")


def test_a_restart_on_other_hosts_is_a_new_plan_from_the_old_one() -> None:
    """A restart's start keeps the job's replicas, id, restarts and error files, on the hosts left;
    the plan it came from is unchanged."""
    from poprun_py.cli.command import parse
    from poprun_py.planning.options import LaunchOptions
    from poprun_py.planning.plan import JobPlan
    from poprun_py.supervision.launch import Start, command_spec

    options = parse(["--num-instances", "4", "--num-replicas", "8", "--max-restarts", "2", "-H", "localhost", "true"])
    assert isinstance(options, LaunchOptions)
    plan = JobPlan(4, 8, hosts=("localhost",), run_id="0123", max_restarts=2, error_dir="/tmp/poprun-0123",
                   restart=1, master_port=1234)
    before = repr(plan)
    start = Start(plan, (), None, lambda: "1234", command_spec(options, plan, None, None), None)
    moved = start.moved(options, 2, ["localhost"])
    assert moved.plan is not plan and repr(plan) == before and start.plan is plan
    new = moved.plan
    assert (new.num_instances, new.hosts, new.num_replicas, new.run_id, new.max_restarts, new.error_dir,
            new.restart, new.master_addr) == (2, ("localhost",), 8, "0123", 2, "/tmp/poprun-0123", 1, "127.0.0.1")
    assert 1 <= int(new.master_port) <= 65535


@pytest.mark.slow  # starts a job twice
def test_a_restart_leaves_poprun_s_own_environment_as_it_was(tmp_path: Path) -> None:
    """Each start's secret and mpiexec's own variables go in the environment mpiexec is started
    with, not poprun's: the discovery script poprun runs before the restart sees neither, and the
    restarted instances see their restart's number."""
    calls = tmp_path / "calls"
    calls.mkdir()
    script = _script(tmp_path, f'env > "{calls}/$(ls "{calls}" | wc -l)"; echo localhost')
    program = ("import os, sys\nprint(os.environ['POPDIST_RESTART_COUNT'], os.environ['TORCHELASTIC_RESTART_COUNT'], "
               "flush=True)\nsys.exit(os.environ['POPDIST_RESTART_COUNT'] == '0')\n")
    result = poprun("--host-discovery-script", script, "--max-restarts", "1", "--restart-backoff", "0",
                    PYTHON, "-c", program)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[0] 0 0\n[0] 1 1\n"
    seen = sorted(calls.iterdir())
    assert [path.name for path in seen] == ["0", "1"]  # the first start's hosts, then the restart's
    first, restart = (dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
                      for path in seen)
    assert restart == first  # no POPRUN_SECRET, no LD_PRELOAD of the loopback library, ...
