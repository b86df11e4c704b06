"""A program's arguments reach it exactly as given, with every mpiexec poprun drives: words of
mpiexec's own syntax (``:``, ``--``, ``-n``, ``-env``, ...), empty strings, newlines, quotes,
bytes that are not UTF-8 and a megabyte of them. What the program receives under poprun is
compared byte for byte with what it receives run directly (``tests/scripts/show_argv.py``)."""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
from pathlib import Path

import pytest

from poprun_py.planning.mpi import MAX_COMMAND_BYTES
from tests.helpers import (
    BIN,
    INSTANCE_COMMAND,
    OPENMPI_LIBMPI,
    OPENMPI_MPIEXEC,
    POPRUN,
    PYTHON,
    ROOT,
    SUBPROCESS_TIMEOUT,
)

pytestmark = pytest.mark.slow  # every test starts poprun

SHOW_ARGV = str(ROOT / "tests" / "scripts" / "show_argv.py")
#: Words mpiexec would read as its own (Hydra's, gforker's, Open MPI's), and words a shell or a
#: config file would split or quote.
MPIEXEC_WORDS = [b":", b"--", b"-n", b"3", b"-np", b"3", b"-env", b"A", b"1", b"-genv", b"B", b"2", b"-genvall",
                 b"--host", b"nowhere", b"-H", b"nowhere", b"-hosts", b"nowhere:1", b"-f", b"/nonexistent",
                 b"-configfile", b"/nonexistent", b"--app", b"/nonexistent", b"-x", b"C=3", b"--mca", b"btl", b"self",
                 b"--oversubscribe", b"-wdir", b"/", b"a:b", b":b", b"a:", b"::", b"-", b"-h", b"--help", b"--version"]
AWKWARD_WORDS = [b"", b"", b"\n", b"a\nb", b"ends\n", b"'", b'"', b"\\", b"a b", b" ", b"\t", b"'x y'", b'"x y"',
                 b"$HOME", b"*", b"~", b"\xff\xfe", b"caf\xe9.py", b"\xe2\x82", b"\x01\x7f"]
#: A megabyte: 1024 arguments of 1 KiB of any bytes but NUL, each led by a word of the lists above.
MEGABYTE = [(word + random.Random(i).randbytes(1024)).replace(b"\0", b"\x01")[:1024]
            for i, word in enumerate((MPIEXEC_WORDS + AWKWARD_WORDS) * 17)][:1024]
CASES = {"mpiexec-words": MPIEXEC_WORDS, "awkward-words": AWKWARD_WORDS, "megabyte": MEGABYTE}
#: How poprun is told to use each mpiexec: gforker is its choice for one host, Hydra its MPICH
#: mpiexec named with --mpi (as for several hosts), and the real Open MPI.
MPIS = {"gforker": [], "hydra": ["--mpi", str(BIN / "mpiexec")], "openmpi": ["--mpi", str(OPENMPI_MPIEXEC)]}
MPI_ENV = {"openmpi": {"MPI4PY_LIBMPI": str(OPENMPI_LIBMPI)}}


def run_bytes(argv: list[bytes | str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, capture_output=True, timeout=SUBPROCESS_TIMEOUT, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def received_directly(args: list[bytes]) -> str:
    """What show_argv.py prints when run directly with ``args``."""
    direct = run_bytes([PYTHON, SHOW_ARGV, *args])
    assert direct.returncode == 0, direct.stderr
    return direct.stdout.decode().strip()


def received_under_poprun(mpi: str, args: list[bytes], *options: str, instances: int = 2) -> dict[str, str]:
    """``{tag: line}`` show_argv.py prints in each instance under poprun with ``mpi``."""
    result = run_bytes([*POPRUN, *MPIS[mpi], *options, "--num-instances", str(instances), PYTHON, SHOW_ARGV, *args],
                       env=MPI_ENV.get(mpi))
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    lines = result.stdout.decode().splitlines()
    return dict(line.split(" ", 1) for line in lines)


@pytest.mark.parametrize("mpi", list(MPIS))
@pytest.mark.parametrize("case", list(CASES))
def test_the_program_receives_its_arguments_byte_for_byte(mpi: str, case: str) -> None:
    args = CASES[case]
    expected = received_directly(args)
    assert received_under_poprun(mpi, args) == {"[0]": expected, "[1]": expected}


@pytest.mark.parametrize("mpi", list(MPIS))
def test_a_colon_does_not_start_a_second_program(tmp_path: Path, mpi: str) -> None:
    """Read by mpiexec, ``--delimiter : touch FILE`` gave the program only ``--delimiter`` and ran
    ``touch FILE`` as more instances."""
    made = tmp_path / "FILE"
    args = [b"--delimiter", b":", b"touch", bytes(made)]
    expected = received_directly(args)
    assert received_under_poprun(mpi, args) == {"[0]": expected, "[1]": expected}
    assert not made.exists()


def test_the_dry_run_shows_the_program_as_given_and_the_mpiexec_command_without_it(tmp_path: Path) -> None:
    made = tmp_path / "FILE"
    args = [b"--delimiter", b":", b"touch", bytes(made), b"", b"a\nb", b"caf\xe9"]
    result = run_bytes([*POPRUN, "--dry-run", "--num-instances", "2", PYTHON, SHOW_ARGV, *args])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split(b"\ncommand: ", 1)[1]
    command, program = lines.split(b"\nprogram: ", 1)
    # The instances' app contexts end with the stub and the instance's index: nothing of the program.
    contexts = [context.split() for context in command.decode().split(" : ")]
    length = len(INSTANCE_COMMAND) + 1
    assert [context[-length:] for context in contexts] == [[*INSTANCE_COMMAND, str(i)] for i in range(2)]
    assert b"touch" not in command and SHOW_ARGV.encode() not in command
    # The program as a shell would take it, its bytes as they are, then how it travels.
    shown, how = program.rsplit(b"\n", 2)[:2]
    assert shlex.split(shown.decode(errors="surrogateescape")) == [
        PYTHON, SHOW_ARGV, *(os.fsdecode(arg) for arg in args)]
    assert how == (b"  (each instance's stub receives it from its host's supervisor, which has it from poprun, byte "
                   b"for byte; mpiexec never reads it)")
    assert not made.exists()


def test_arguments_with_white_space_arrive_whole_from_a_job_in_mpiexecs_config_file() -> None:
    """A job whose command would be too long goes to mpiexec's config file, whose lines are split at
    white space: arguments with spaces and newlines still arrive whole (a long variable in every
    app context makes this job's command that long; Hydra takes lines of up to 16 KiB)."""
    args = [b"a b", b"", b"x\ny", b":", b"caf\xe9"]
    expected = received_directly(args)
    padding = "x" * (MAX_COMMAND_BYTES // 5 + 2000)
    received = received_under_poprun("hydra", args, "--mpi-local-args", f"-env PADDING {padding}", instances=5)
    assert received == {f"[{i}]": expected for i in range(5)}


#: What a job puts in its config file beside each instance's own variables, in each MPI's syntax:
#: a variable for every instance and one for instance 1, values with characters a shell would quote.
LOCAL_ARGS = {"hydra": ("-env EVERY (x);<y>|~#", "1:-env ODD a&b*$c!"),
              "openmpi": ("-x EVERY=(x);<y>|~#", "1:-x ODD=a&b*$c!")}
#: A variable of MPI's global options long enough that the command needs the config file; those
#: options stay on mpiexec's command line, with the file.
GLOBAL_PADDING = {"hydra": "-genv GLOBAL_PADDING ", "openmpi": "-x GLOBAL_PADDING="}
SHOW_ENVIRONMENT = ("import json, os, sys\n"
                    "e = os.environ\n"
                    "print(json.dumps([e['POPDIST_INSTANCE_INDEX'], e['RANK'], e.get('EVERY'), e.get('ODD'), "
                    "len(e.get('GLOBAL_PADDING', '')), [os.fsencode(a).hex() for a in sys.argv[1:]]]))\n")


@pytest.mark.parametrize("mpi", ["hydra", "openmpi"])
def test_a_job_in_mpiexecs_config_file_gives_each_instance_its_environment_and_arguments_exactly(mpi: str) -> None:
    """A job whose command would be longer than 64 KiB gives mpiexec its app contexts in a file
    (Hydra's -configfile, Open MPI's --app) with short lines, which Open MPI reads in 1 KiB: each
    instance gets its own variables from there, the local arguments' values arrive unquoted (the
    file once had them shell-quoted, and the quotes stayed in the value, or set no variable), the
    global options still apply, and the program's arguments come over the control channel."""
    every, odd = LOCAL_ARGS[mpi]
    options = [*MPIS[mpi], "--mpi-global-args", GLOBAL_PADDING[mpi] + "x" * MAX_COMMAND_BYTES,
               "--mpi-local-args", every, "--instance-mpi-local-args", odd, "--num-instances", "3"]
    args = [b"a b", b"", b"x\ny", b":", b"caf\xe9", b"'q'"]
    dry = run_bytes([*POPRUN, "--dry-run", *options, PYTHON, "-c", SHOW_ENVIRONMENT, *args])
    assert dry.returncode == 0, dry.stderr
    shown = dry.stdout.decode(errors="surrogateescape").splitlines()
    command = next(line for line in shown if line.startswith("command: "))
    assert command.endswith(" --app '<config-file>'" if mpi == "openmpi" else " -configfile '<config-file>'")
    assert "<config-file>: 3 lines (the command line would be too long)" in shown
    assert sum(line.endswith(f" {every} {odd[2:]} {' '.join(INSTANCE_COMMAND)} 1") for line in shown) == 1
    result = run_bytes([*POPRUN, *options, PYTHON, "-c", SHOW_ENVIRONMENT, *args], env=MPI_ENV.get(mpi))
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    received = sorted(line.split(" ", 1) for line in result.stdout.decode().splitlines())
    hexed = [arg.hex() for arg in args]
    assert received == [[f"[{i}]", json.dumps([str(i), str(i), "(x);<y>|~#", "a&b*$c!" if i == 1 else None,
                                               MAX_COMMAND_BYTES, hexed])] for i in range(3)]


@pytest.mark.parametrize("mpi", ["gforker", "openmpi"])
def test_a_program_and_script_whose_paths_are_not_utf8_are_run(tmp_path: Path, mpi: str) -> None:
    """The program's own path goes the same way: poprun checks it, the stub starts it, by its bytes."""
    folder = os.fsencode(tmp_path)
    program, script = folder + b"/py\xe9thon", folder + b"/sh\xf6w \xff.py"
    os.symlink(os.fsencode(PYTHON), program)
    os.symlink(os.fsencode(SHOW_ARGV), script)
    direct = run_bytes([program, script, b"caf\xe9"])
    assert direct.returncode == 0, direct.stderr
    result = run_bytes([*POPRUN, *MPIS[mpi], "--num-instances", "2", program, script, b"caf\xe9"], env=MPI_ENV.get(mpi))
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    expected = direct.stdout.decode().strip()
    assert sorted(result.stdout.decode().splitlines()) == [f"[0] {expected}", f"[1] {expected}"]
