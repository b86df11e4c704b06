"""Host lists and the job plan, without launching anything."""

import os
from pathlib import Path

import pytest

from poprun_py.planning.hosts import count_hosts, expand_hosts, read_host_file
from poprun_py.planning.plan import JobPlan
from poprun_py.shared.errors import PlanError


@pytest.mark.parametrize("spec,hosts", [
    ("a", ["a"]),
    ("a,b", ["a", "b"]),
    ("node[0-2,4]", ["node0", "node1", "node2", "node4"]),
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("r[1-2]x,gpu7", ["r1x", "r2x", "gpu7"]),
    (" a , b ,", ["a", "b"]),
    # Slurm node lists (SLURM_JOB_NODELIST): zero padding kept, several groups, several bracket sets
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu[007-009,010],cpu1", ["gpu007", "gpu008", "gpu009", "gpu010", "cpu1"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
])
def test_expand_hosts(spec: str, hosts: list[str]) -> None:
    assert expand_hosts(spec) == hosts


def test_host_file_with_comments_and_slots(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode[0-1] slots=4\n\nhead  # login\n")
    assert read_host_file(path) == (["node0", "node1", "head"], {"node0": 4, "node1": 4})


@pytest.mark.parametrize("spec,message", [
    ("localhost,localhost", ("host list 'localhost,localhost' lists the host 'localhost' twice (hosts 0 and 1); list "
                            "each host once: poprun spreads the instances evenly over the hosts")),
    ("node[0-2],node1", "host list 'node[0-2],node1' lists the host 'node1' twice (hosts 1 and 3)"),
    ("a," + "x" * 254, "names a host of 254 characters ('" + "x" * 60 + "...'); a host name has at most 253"),
    ("a,b\tc", "host list 'a,b\\tc' names the host 'b\\tc', which holds '\\t'; a host is a name of ASCII letters"),
])
def test_a_host_listed_twice_or_that_cannot_be_a_name_is_refused(spec: str, message: str) -> None:
    with pytest.raises(PlanError) as refused:
        expand_hosts(spec)
    assert message in str(refused.value)


def test_a_host_file_with_crlf_lines_and_a_host_twice(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_bytes(b"node0\r\nnode1\r\n")
    assert read_host_file(path) == (["node0", "node1"], {})
    path.write_bytes(b"localhost\r\nlocalhost\r\n")
    with pytest.raises(PlanError, match=r"lists the host 'localhost' twice \(hosts 0 and 1\)"):
        read_host_file(path)


def test_plan_layout_consecutive_instances_share_a_host() -> None:
    plan = JobPlan(4, 8, hosts=("h0", "h1"))
    layout = [(i.host, i.local_index, list(i.replicas)) for i in plan.instances]
    assert layout == [("h0", 0, [0, 1]), ("h0", 1, [2, 3]), ("h1", 0, [4, 5]), ("h1", 1, [6, 7])]
    assert plan.instance_env(3) == {"POPDIST_INSTANCE_INDEX": "3", "POPDIST_LOCAL_INSTANCE_INDEX": "1",
                                    "POPDIST_REPLICA_INDEX_OFFSET": "6", "RANK": "3", "LOCAL_RANK": "1",
                                    "GROUP_RANK": "1", "ROLE_RANK": "3"}  # torchrun's: host h1 is group 1
    assert plan.job_env()["LOCAL_WORLD_SIZE"] == "2" and plan.job_env()["GROUP_WORLD_SIZE"] == "2"


def test_plan_rejects_non_integers() -> None:
    with pytest.raises(PlanError, match=r"--num-instances must be a positive integer, got 1.5"):
        JobPlan(1.5, 3)  # type: ignore[arg-type]


def test_host_range_errors_name_the_range() -> None:
    with pytest.raises(PlanError, match=r"host range 'x' in 'r\[1\]n\[x\]' is not 'N' or 'N-M'"):
        expand_hosts("r[1]n[x]")


def test_large_plan_is_described_by_its_ends() -> None:
    plan = JobPlan(4096, 4096, hosts=tuple(expand_hosts("n[0000-1023]")))
    lines = plan.describe().splitlines()
    assert lines[0].startswith("job: 4096 instance(s) x 1 local replica(s)") and len(lines) == 18
    assert "  ... 4080 more ..." in lines
    assert lines[-1] == "  instance 4095 on n1023 (local index 3): replicas 4095"
    with pytest.raises(PlanError) as error:
        JobPlan(4095, 4095, hosts=plan.hosts)
    assert len(str(error.value)) < 200 and "... 1016 more ..., n1022, n1023" in str(error.value)


def test_host_lists_are_counted_before_they_are_expanded() -> None:
    assert count_hosts("n[0-99999999],m[1-2]x[01-03]") == 100_000_006
    assert len(expand_hosts("n[0-65535]")) == 65536
    with pytest.raises(PlanError, match=r"host list 'n\[0-65536\]' names 65537 hosts, more than poprun runs on "
                                        r"\(at most 65536"):
        expand_hosts("n[0-65536]")
    with pytest.raises(PlanError, match=r"is not 'N' or 'N-M' with non-negative integers \(at most 18 digits\)"):
        expand_hosts("n[0-" + "9" * 5000 + "]")


def test_host_files_are_read_in_bounded_time_and_memory(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes: reads as empty instead of waiting
    with pytest.raises(PlanError, match="lists no hosts"):
        read_host_file(fifo)
    with pytest.raises(PlanError, match=r"host file '/dev/zero' is larger than 16 MiB"):
        read_host_file("/dev/zero")
    many = tmp_path / "many"
    many.write_text("n[0-99999]\n" * 20)
    with pytest.raises(PlanError, match=r"names 2000000 hosts, more than poprun runs on \(at most 65536"):
        read_host_file(many)
    lines = tmp_path / "lines"
    lines.write_text("\n" * (1 << 20 | 1))
    with pytest.raises(PlanError, match=r"has more than 1048576 lines"):
        read_host_file(lines)
    binary = tmp_path / "binary"
    binary.write_bytes("a\n".encode("utf-16"))
    with pytest.raises(PlanError, match=r"is binary or UTF-16, not text"):
        read_host_file(binary)


def test_a_plan_is_immutable_and_a_changed_plan_is_a_new_checked_one() -> None:
    plan = JobPlan(4, 8, hosts=("h0", "h1"), run_id="r", max_restarts=2, error_dir="/tmp/e", master_port=1234)
    before = repr(plan)
    for name in JobPlan.__slots__:
        with pytest.raises(AttributeError, match="immutable"):
            setattr(plan, name, getattr(plan, name))
        with pytest.raises(AttributeError, match="immutable"):
            delattr(plan, name)
    with pytest.raises(AttributeError, match="immutable"):
        plan.instance(0).host = "h1"  # type: ignore[misc]
    moved = plan.replace(num_instances=2, hosts=("h1",), restart=1)
    assert moved is not plan and repr(plan) == before  # the old plan is as it was
    assert (moved.num_instances, moved.hosts, moved.num_replicas, moved.restart) == (2, ("h1",), 8, 1)
    assert (moved.run_id, moved.max_restarts, moved.error_dir, moved.master_port) == ("r", 2, "/tmp/e", 1234)
    assert moved.job_env()["POPDIST_RESTART_COUNT"] == moved.job_env()["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert plan.replace() == plan and plan.replace() is not plan
    with pytest.raises(PlanError, match="--num-replicas 8 cannot be divided evenly among --num-instances 3"):
        plan.replace(num_instances=3)
    with pytest.raises(PlanError, match=r"restart 3 is outside the job's restarts 0\.\.2 \(--max-restarts\)"):
        plan.replace(restart=3)
    with pytest.raises(TypeError, match="no field"):
        plan.replace(instances=3)
