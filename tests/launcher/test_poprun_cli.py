"""The command line: how it is read, usage errors, help, --dry-run commands for MPICH and Open MPI,
compatibility options. Config files: test_poprun_config.py."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import pytest

from popcontract import compiled, environment
from poprun_py import __version__
from tests.helpers import (
    INSTANCE_COMMAND,
    MPICH_MPIEXEC,
    OPENMPI_MPIEXEC,
    PYTHON,
    ROOT,
    job_marker,
    poprun,
    wait_no_processes,
)

pytestmark = pytest.mark.slow  # every test starts poprun (a --dry-run too is a process)


@pytest.fixture
def openmpi() -> str:
    # Installed by `make install` (a separate venv: its mpiexec must not shadow MPICH's).
    assert OPENMPI_MPIEXEC.exists(), f"{OPENMPI_MPIEXEC} missing: run `make install`"
    return str(OPENMPI_MPIEXEC)


@pytest.fixture
def unreadable_file(tmp_path: Path) -> str:
    return str(tmp_path / "missing-hosts")


BAD_INPUTS = [
    (["--num-instances", "3", "--num-replicas", "4"],
     "--num-replicas 4 cannot be divided evenly among --num-instances 3"),
    (["--num-instances", "3", "-H", "a,b"], "--num-instances 3 cannot be spread evenly over 2 hosts (a, b)"),
    (["-H", "a", "--host-file", "hosts.txt"], "--host and --host-file exclude each other"),
    (["--num-instances", "0"], "0 is not in the range 1<=x<=65536"),
    (["--num-replicas", "-2"], "-2 is not in the range 1<=x<=65536"),
    (["--ipus-per-replica", "0"], "0 is not in the range 1<=x<=65536"),
    (["--num-instances", "two"], "Invalid value for '--num-instances': 'two' is not a whole number in plain decimal"),
    # Counts are plain decimal digits (int() alone would read '2_0' as 20, and a fullwidth 2 as 2) ...
    (["--num-instances", "2_0"], ("Invalid value for '--num-instances': '2_0' is not a whole number in plain "
                                  "decimal digits (0-9), e.g. 4")),
    (["--num-replicas", "\uff12"], "'\uff12' is not a whole number in plain decimal digits"),
    (["--num-instances", "+2"], "'+2' is not a whole number"),
    # ... within bounds checked before anything is built (these ran out of memory).
    (["--num-instances", "1000000000"],
     "Invalid value for '--num-instances': 1000000000 is more than poprun can start (at most 65536)"),
    (["--num-instances", "9" * 100_000], "99999999999999999999... is more than poprun can start (at most 65536)"),
    (["--num-replicas", "65537"], "65537 is more than poprun supports (at most 65536)"),
    (["--only-output-from-instance", "65536"], "65536 is past the last instance poprun can start (at most 65535)"),
    (["--num-instances", "2", "--only-output-from-instance", "2"],
     "--only-output-from-instance 2 is outside the instances 0..1"),
    (["--only-output-from-instance", "-1"], "-1 is not in the range 0<=x<=65535"),
    (["--host-file", "{unreadable}"], "Invalid value for '--host-file': File '{unreadable}' does not exist."),
    (["--host-file", "."], "Invalid value for '--host-file': File '.' is a directory."),
    (["-H", ","], "host list ',' names no hosts"),
    (["-H", "node[3-1]"], "host range '3-1' in 'node[3-1]' runs backwards"),
    (["-H", "node[a-b]"], "host range 'a-b' in 'node[a-b]' is not 'N' or 'N-M'"),
    (["-H", "node[0-1"], "host list 'node[0-1' has unbalanced brackets"),
    # Host lists are counted before they are expanded; host files are read up to 16 MiB.
    (["-H", "n[0-99999999]"],
     "host list 'n[0-99999999]' names 100000000 hosts, more than poprun runs on (at most 65536, one instance"),
    (["-H", "n[0-9]x[0-99999]"], "names 1000000 hosts, more than poprun runs on (at most 65536"),
    (["--host-file", "/dev/zero"], "host file '/dev/zero' is larger than 16 MiB"),
    (["--num-instances", "2", "--instance-mpi-local-args", "one:-env A 1"],
     "--instance-mpi-local-args 'one:-env A 1' is not of the form I:ARGS"),
    (["--num-instances", "2", "--instance-mpi-local-args", "-env A 1"], "is not of the form I:ARGS"),
    (["--num-instances", "2", "--instance-mpi-local-args", "5:-env A 1"], "names instance 5, but instances are 0..1"),
    (["--mpi-global-args", "-foo 'unbalanced"], "--mpi-global-args \"-foo 'unbalanced\" cannot be split"),
    # A yes/no option's value follows "=" (a word that is not yes/no after it is the program).
    (["--print-topology=maybe"], "Invalid value for '--print-topology': 'maybe' is not yes or no"),
    (["--offline-mode="], "Invalid value for '--offline-mode': '' is not yes or no"),
    (["--numa-aware=sometimes"], "'sometimes' is not yes or no"),
    (["--mpi", "/no/such/mpiexec"], "--mpi '/no/such/mpiexec' is not an executable file"),
    (["--mpi", "/bin/echo"], "is neither MPICH (Hydra) nor Open MPI"),
    (["--import-config", "{unreadable}"], "Invalid value for '--import-config': File '{unreadable}' does not exist."),
    (["--export-config", "."], "Invalid value for '--export-config': File '.' is a directory."),
    (["--no-such-option"], "No such option '--no-such-option'"),
    # Other launchers' options name poprun's (click reads -np as -n, -hostfile as -h -o ...).
    (["-np", "2"], "No such option '-np' (poprun's option is --num-instances N)."),
    (["-n", "2"], "No such option '-n' (poprun's option is --num-instances N)."),
    (["--np=2"], "No such option '--np' (poprun's option is --num-instances N)."),
    (["--nproc_per_node", "2"], "No such option '--nproc_per_node' (poprun's option is --num-instances N, the total"),
    (["--nproc-per-node=2"], "No such option '--nproc-per-node' (poprun's option is --num-instances N, the total"),
    (["-N", "2"], "No such option '-N' (poprun's option is --num-instances N, the total over all hosts)."),
    (["-hostfile", "hosts.txt"], "No such option '-hostfile' (poprun's option is --host-file FILE)."),
    (["--dry-run=yes"], "Option '--dry-run' does not take a value"),
]


@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[" ".join(a)[:40] for a, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_line_and_status_2(args: list[str], message: str, unreadable_file: str,
                                                  tmp_path: Path) -> None:
    (tmp_path / "hosts.txt").write_text("a\n")
    args = [a.replace("{unreadable}", unreadable_file) for a in args]
    message = message.replace("{unreadable}", unreadable_file)
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


def _read(tmp_path: Path, *argv: str) -> tuple[dict[str, Any], list[str]]:
    """What poprun made of ``argv``: its options (as --export-config writes them) and the program
    each instance runs (from the --dry-run). ``tmp_path`` comes first on PATH."""
    config = tmp_path / "effective.json"
    stdout, _ = _dry_run("--export-config", str(config), *argv, cwd=tmp_path,
                         env={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    program = next(line for line in stdout.splitlines() if line.startswith("program: "))
    return json.loads(config.read_text()), shlex.split(program[len("program: "):])


READINGS = [
    (["/bin/echo", "a b"], {"num-instances": 1, "num-replicas": None, "print-topology": False, "verbose": 0},
     ["/bin/echo", "a b"]),
    (["--num-instances=2", "--num-replicas", "8", "--print-topology", "Yes", "--numa-aware", "off", "/bin/echo"],
     {"num-instances": 2, "num-replicas": 8, "print-topology": True, "numa-aware": False}, ["/bin/echo"]),
    (["-vvH", "localhost", "--instance-mpi-local-args", "0:-env A 1", "--instance-mpi-local-args=0:-env B 2",
      "/bin/echo"],
     {"verbose": 2, "host": "localhost", "instance-mpi-local-args": ["0:-env A 1", "0:-env B 2"]}, ["/bin/echo"]),
    # Option values may start with '-'; the first word that is not an option is the program, and
    # everything after it is the program's, options included.
    (["--mpi-global-args", "-verbose", "--executable-cache-path", "/tmp/c", "/bin/echo", "--num-instances", "3",
      "-h"], {"num-instances": 1, "mpi-global-args": "-verbose", "executable-cache-path": "/tmp/c"},
     ["/bin/echo", "--num-instances", "3", "-h"]),
    # After '--', even a word that looks like an option is the program (here a path starting with '-').
    (["--only-output-from-instance", "0", "--", "-program", "--help"], {"only-output-from-instance": 0},
     ["-program", "--help"]),
]


@pytest.mark.parametrize("argv,options,program", READINGS, ids=[" ".join(a) for a, _, _ in READINGS])
def test_how_a_command_line_is_read(
    tmp_path: Path, argv: list[str], options: dict[str, object], program: list[str]
) -> None:
    (tmp_path / "-program").symlink_to("/bin/echo")  # found on PATH (see _read)
    read, line = _read(tmp_path, *argv)
    assert {key: read[key] for key in options} == options
    assert line == program


def _dry_run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> tuple[str, list[str]]:
    result = poprun("--dry-run", *args, cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr
    command_line = next(line for line in result.stdout.splitlines() if line.startswith("command: "))
    return result.stdout, shlex.split(command_line[len("command: "):])


def _contexts(command: list[str]) -> list[list[str]]:
    contexts: list[list[str]] = []
    current: list[str] = []
    for token in command[1:]:
        if token == ":":
            contexts.append(current)
            current = []
        else:
            current.append(token)
    return [*contexts, current]


def test_dry_run_mpich_command(tmp_path: Path) -> None:
    host_file = tmp_path / "hosts"
    host_file.write_text("node0\nnode1  # second\n")
    stdout, command = _dry_run("--num-instances", "4", "--num-replicas", "8", "--host-file", str(host_file),
                               "--mpi", str(MPICH_MPIEXEC), "--mpi-global-args", "-verbose", "--numa-aware", "yes",
                               "python", "train.py", "--lr", "0.1")
    assert "instance 3 on node1 (local index 1): replicas 6-7" in stdout
    assert "mpi: mpich 5" in stdout
    # One host list for the job (Hydra allows one), filled in order; remote hosts call back on
    # poprun's address (a placeholder: a dry run resolves no names); ssh is bounded in time.
    assert command[:8] == [str(MPICH_MPIEXEC), "-verbose", "-hosts", "node0:2,node1:2", "-localhost",
                           "<poprun-address>", "-bind-to", "numa"]
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
        # Each runs the stub, which gets the program from its host's supervisor: mpiexec never reads it.
        assert ctx[-len(INSTANCE_COMMAND) - 1:] == [*INSTANCE_COMMAND, str(i)]
    assert "train.py" not in command and "program: python train.py --lr 0.1" in stdout.splitlines()


@pytest.mark.parametrize("theirs", ["-o Port=2222", ""])
def test_ssh_options_the_user_set_stand_even_empty(theirs: str, openmpi: str) -> None:
    # poprun's own ssh options (batch mode, time limits) only when the user has set none: set,
    # even to nothing, the variable is the user's, and mpiexec inherits it as it is.
    for mpi, name in ((str(MPICH_MPIEXEC), environment.HYDRA_SSH_ARGS), (openmpi, environment.PRTE_SSH_ARGS)):
        stdout, _ = _dry_run("--num-instances", "2", "-H", "node0,node1", "--mpi", mpi, "/bin/true",
                             env={name: theirs})
        assert f"{name}=" not in stdout, (mpi, stdout)


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
        # Local args come right before the instance's stub.
        assert joined.endswith(f"-x NCCL_DEBUG {' '.join(INSTANCE_COMMAND)} {i}")
    assert "program: python train.py" in stdout.splitlines()


def test_dry_run_starts_nothing() -> None:
    marker = job_marker()
    result = poprun("--dry-run", "--num-instances", "2", PYTHON, "-c", f"open('{marker}', 'w')")
    assert result.returncode == 0 and not Path(ROOT / marker).exists()


def test_real_openmpi_launch_and_teardown(openmpi: str) -> None:
    ok = poprun("--mpi", openmpi, "--num-instances", "3", "--num-replicas", "6",
                PYTHON, str(ROOT / "tests" / "scripts" / "print_env.py"))
    assert ok.returncode == 0, ok.stderr
    offsets = sorted(line.split(" ", 1)[0] + json.loads(line.split(" ", 1)[1])["POPDIST_REPLICA_INDEX_OFFSET"]
                     for line in ok.stdout.splitlines())
    assert offsets == ["[0]0", "[1]2", "[2]4"]
    marker = job_marker()
    failed = poprun("--mpi", openmpi, "--num-instances", "2", PYTHON, str(ROOT / "tests" / "scripts" / "behave.py"),
                    marker, "0:exit=4")
    assert failed.returncode == 4 and "instance 0 on" in failed.stderr
    assert wait_no_processes(marker) == []


def test_vipu_options_are_accepted_with_a_warning() -> None:
    result = poprun("--vipu-server-host", "vipu.local", "--vipu-partition", "p1", "--num-ilds", "2",
                    "--update-partition", "yes", "/bin/echo", "ran")
    assert result.returncode == 0
    assert result.stdout == "[0] ran\n"
    warnings = [line for line in result.stderr.splitlines() if "has no effect" in line]
    assert len(warnings) == 4
    assert any("--vipu-server-host has no effect" in w for w in warnings)


def test_help_lists_every_option_with_its_default() -> None:
    result = poprun("-h")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("Usage: poprun [OPTIONS] PROGRAM [ARGS]...")
    for option in ("--num-instances N", "--num-replicas N", "--ipus-per-replica N", "-H, --host LIST",
                   "--host-file FILE", "--host-subnet CIDR", "--mpi-global-args ARGS", "--mpi-local-args ARGS",
                   "--instance-mpi-local-args I:ARGS", "--only-output-from-instance I", "--print-topology YES|NO",
                   "--numa-aware YES|NO", "--offline-mode YES|NO", "--executable-cache-path DIR",
                   "--import-config FILE", "--export-config FILE", "--overwrite-config", "--mpi PATH",
                   "--dry-run", "-v, --verbose", "--vipu-server-host VALUE", "--num-ilds VALUE", "--version",
                   "-h, --help"):
        assert option in result.stdout, option
    text = " ".join(result.stdout.split())  # unwrapped
    assert "Processes to start. [default: 1; 1<=x<=65536]" in text
    assert "(default: one per instance). [1<=x<=65536]" in text
    assert "Bind instances to NUMA nodes. [default: no]" in text


def test_version_names_each_compiled_part() -> None:
    # This checkout's build (make install) has every part: a line each, present and what it does
    # (tests/integration/test_compiled_parts.py checks what an install without them says).
    result = poprun("--version", env={"POPRUN_STUB": ""})  # (the default)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"poprun {__version__}",
                                          *(f"{part.module}: present - {part.role}" for part in compiled.PARTS),
                                          ("each instance on this host runs under: the compiled stub (one supervisor "
                                           "per host) (POPRUN_STUB=compiled)")]


@pytest.mark.parametrize(("stub", "runs"), [
    (" Python ", "the stub's Python fallback (one supervisor per host) (POPRUN_STUB=python)"),
    ("shim", "none: POPRUN_STUB='shim' is not one of compiled, python")])
def test_version_says_what_runs_each_instance(stub: str, runs: str) -> None:
    result = poprun("--version", env={"POPRUN_STUB": stub})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"each instance on this host runs under: {runs}"


def test_help_groups_every_option_once_with_the_no_ops_last() -> None:
    """--help's sections: launch, hosts, output, failures, MPI, config files, then PopRun's options
    that do nothing here; each option in exactly one of them."""
    from poprun_py.cli.command import HELP_SECTIONS
    from poprun_py.cli.command import poprun as command

    grouped = [name for names in HELP_SECTIONS.values() for name in names]
    options = ["help" if "--help" in p.opts else p.name for p in command.params if isinstance(p, click.Option)]
    assert sorted(grouped) == sorted([*options, "help"]) and len(grouped) == len(set(grouped))
    out = poprun("--help").stdout
    titles = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert [t for t in titles if not t.startswith("Usage")] == list(HELP_SECTIONS)
    noops = out.split("PopRun options that do nothing here")[1]
    assert "--vipu-server-host VALUE" in noops and "--offline-mode" in noops and "--num-instances" not in noops


@pytest.mark.parametrize(("argv", "given"), [
    (["--print-topology", "hostname"], {"print-topology": True, "program": "hostname"}),
    (["--print-topology", "no", "hostname"], {"print-topology": False, "program": "hostname"}),
    (["--print-topology=no", "hostname"], {"print-topology": False, "program": "hostname"}),
    (["--tee", "--log-dir", "d", "--print-topology", "-v", "hostname", "--tee"],
     {"tee": True, "print-topology": True, "verbose": 1, "program": "hostname", "args": ("--tee",)}),
    (["--prefix-timestamp", "--", "no"], {"prefix-timestamp": True, "program": "no"}),
    (["--numa-aware", "off", "-H", "yes", "true"], {"numa-aware": False, "host": "yes", "program": "true"}),
])
def test_a_yes_no_option_alone_means_yes(argv: list[str], given: dict[str, object]) -> None:
    from poprun_py.cli.command import parse
    from poprun_py.planning.options import LaunchOptions

    options = parse(argv)
    assert isinstance(options, LaunchOptions)
    fields: Mapping[str, object] = _option_values(options)  # looked up by names built from the option names
    assert {k: fields[k.replace("-", "_")] for k in given} == given


@pytest.mark.parametrize("flag", ["--print-topology", "--tee", "--prefix-timestamp", "--numa-aware", "--offline-mode"])
@pytest.mark.parametrize("word, program", [("maybe", "a program on PATH"), ("./maybe", "an executable file")])
def test_a_yes_no_option_alone_then_a_word_that_is_no_program_is_refused(flag: str, word: str, program: str,
                                                                          tmp_path: Path) -> None:
    # Neither reading works: 'maybe' is no yes/no word, and no program 'maybe' can be run here.
    # The program after it is never started.
    ran = tmp_path / "ran"
    result = poprun(flag, word, "/bin/sh", "-c", f"touch {ran}", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"poprun: error: Invalid value for '{flag}': '{word}' is not yes or no, nor {program}; "
                             f"give '{flag} yes' or '{flag} no' before the program\n")
    assert not ran.exists()


def test_a_yes_no_option_alone_then_a_program_by_its_path_runs_it(tmp_path: Path) -> None:
    script = tmp_path / "maybe"
    script.write_text("#!/bin/sh\necho ran \"$@\"\n")
    script.chmod(0o755)
    result = poprun("--print-topology", "./maybe", "x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "poprun topology" in result.stdout and result.stdout.endswith("[0] ran x\n")


def test_verbose_logs_the_command() -> None:
    result = poprun("-vv", "--num-instances", "2", "/bin/true")
    assert result.returncode == 0
    assert "POPRUN [I] running command: " in result.stderr
    assert "POPRUN [D] instance 1 connected" in result.stderr


def _option_values(options: Any) -> dict[str, object]:
    """LaunchOptions' values by option name, its groups flattened (a name in two places fails)."""
    from poprun_py.planning.options import GROUPS

    found: dict[str, object] = {}
    for name, value in zip(options._fields, options, strict=True):
        pairs = zip(value._fields, value, strict=True) if name in GROUPS else [(name, value)]
        for key, item in pairs:
            assert key not in found, f"{key} is in LaunchOptions twice"
            found[key] = item
    return found


def _other_words(param: click.Parameter, default: object, tmp_path: Path) -> list[str]:
    """Words before the program that give ``param`` a valid value other than ``default``; or, for
    the program and its arguments, the words that replace the program ``true``."""
    from poprun_py.cli import command

    if isinstance(param, click.Argument):
        return ["false"] if param.name == "program" else ["true", "an argument"]
    assert isinstance(param, click.Option)
    flag = param.opts[-1]
    if param.is_flag or param.count:
        return [flag]
    kind = param.type
    if isinstance(kind, command.YesNo):
        return [flag, "no" if default else "yes"]
    if isinstance(kind, command.Count):
        assert kind.min is not None
        return [flag, str(kind.min if default is None else int(str(default)) + 1)]
    if isinstance(kind, command.FileName):
        path = tmp_path / param.opts[-1].lstrip("-")
        if kind.exists:
            path.write_text("localhost\n")
        return [flag, str(path)]
    return [flag, "0:-v" if param.multiple else "x"]  # --instance-mpi-local-args takes I:ARGS


def test_launch_options_hold_every_option_that_reaches_launch_each_in_its_own_field(tmp_path: Path) -> None:
    """Every parameter of the click command but the V-IPU ones (warned about, dropped) and
    --import-config (click's own) is one field of LaunchOptions, and giving it changes that field
    alone, to the value click read: derived from the command's parameters, not a list."""
    from poprun_py.cli import command
    from poprun_py.planning.options import LaunchOptions

    vipu = {flag[2:].replace("-", "_") for flag in command.VIPU_FLAGS}
    params = [p for p in command.poprun.params if p.expose_value and p.name not in vipu]
    baseline = command.parse(["true"])
    assert isinstance(baseline, LaunchOptions)
    assert set(_option_values(baseline)) == {p.name for p in params}
    before = _option_values(baseline)
    for param in params:
        words = _other_words(param, before[str(param.name)], tmp_path)
        given = command.parse(words if isinstance(param, click.Argument) else [*words, "true"])
        assert isinstance(given, LaunchOptions), (param.name, words)
        after = _option_values(given)
        assert {name for name in after if after[name] != before[name]} == {param.name}, words


def test_launch_options_are_frozen() -> None:
    from poprun_py.cli import command
    from poprun_py.planning.options import LaunchOptions

    options = command.parse(["--num-instances", "2", "-H", "a,b", "true"])
    assert isinstance(options, LaunchOptions)
    with pytest.raises(AttributeError):
        options.num_instances = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        options.hosts.host = "c"  # type: ignore[misc]
    assert (options.num_instances, options.hosts.host) == (2, "a,b")




@pytest.mark.parametrize(("argv", "said"), [
    (["-H", "a", "--host-file", "{file}"], "--host and --host-file exclude each other"),
    (["--num-instances", "2", "--only-output-from-instance", "2"], "--only-output-from-instance 2 is outside"),
    (["--mpi-local-args", "-foo 'unbalanced"], "--mpi-local-args \"-foo 'unbalanced\" cannot be split"),
    (["--instance-mpi-local-args", "3:-v"], "--instance-mpi-local-args '3:-v' names instance 3"),
])
def test_what_the_options_alone_make_wrong_is_refused_as_they_are_read(argv: list[str], said: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Before anything is looked up or started: parse itself gives status 2 and says it in one line."""
    from poprun_py.cli.command import parse

    hosts = tmp_path / "hosts"
    hosts.write_text("a\n")
    assert parse([word.format(file=hosts) for word in argv] + ["true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"poprun: error: {said}") and err.count("\n") == 1, err
