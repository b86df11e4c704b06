"""Host names from every source (-H, host files, each scheduler's variable, the discovery script)
reach ssh, a launcher agent and mpiexec: one that is not a host's name (an option, shell syntax, a
control character) is refused in one line naming it and its source, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from poprun_py.planning.host_sources import PRECEDENCE
from tests.helpers import poprun

pytestmark = pytest.mark.slow  # every test starts poprun

VARIABLES = [name for source in PRECEDENCE for name in (source.variable, source.slots_variable) if name]
#: The end of every refusal: what a host may be.
VALID = ("a host is a name of ASCII letters, digits, '-' and '_' in labels joined by '.' (RFC 1123: no label begins "
         "or ends with '-'; at most 63 characters each) or an IPv4 address, optionally after 'user@'")


@pytest.fixture(autouse=True)
def no_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the variables it reads; none comes from the environment pytest runs in."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _refused(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """poprun's one line for ``args``, after checking that it is one line with status 2 and nothing else."""
    result = poprun(*args, env=env, cwd=cwd)
    lines = result.stderr.splitlines()
    assert (result.returncode, len(lines), result.stdout) == (2, 1, ""), result
    assert lines[0].startswith("poprun: error: ") and lines[0].endswith(VALID), lines[0]
    return lines[0].removeprefix("poprun: error: ").removesuffix(VALID)


BAD = [
    ("-oProxyCommand=x", "begins with '-' (ssh and mpiexec would read it as an option)"),
    ("-x", "begins with '-' (ssh and mpiexec would read it as an option)"),
    ("n0,;rm", "holds ';'"),
    ("a$(id)", "holds '$'"),
    ("a`id`", "holds '`'"),
    ("a|b", "holds '|'"),
    ("a&b", "holds '&'"),
    ("a<b", "holds '<'"),
    ("a>b", "holds '>'"),
    ("a\"b", "holds '\"'"),
    ("a\\b", "holds '\\\\'"),
    ("a*", "holds '*'"),
    ("a b", "holds ' '"),
    ("a\tb", "holds '\\t'"),
    ("a\x1bcb", "holds '\\x1b'"),
    ("a\x7fb", "holds '\\x7f'"),
    ("n\u00f6de", "holds '\u00f6'"),
    ("node[0-1]x;", "holds ';'"),
    ("node0:2", ("holds ':' (a host file gives a host's slots as 'host:N'; an IPv6 address cannot be given, "
                 "mpiexec's host lists read its ':' as slots: give the host's name)")),
    ("fe80::1", "holds ':'"),
    ("a..b", "has an empty label (a '.' at its start, or two in a row)"),
    (".a", "has an empty label"),
    ("a-.b", "has the label 'a-', which begins or ends with '-'"),
    ("u@-n", "has the label '-n', which begins or ends with '-'"),
    ("@n", "has '' before '@', not a user name (letters, digits, '_', '.' and '-', not first)"),
    ("u@v@n", "has 'u@v' before '@', not a user name"),
    ("x" * 64, "has a label of 64 characters"),
]


@pytest.mark.parametrize("given,why", BAD, ids=[repr(b[0])[:30] for b in BAD])
def test_a_host_that_is_not_a_name_is_one_line_before_anything_starts(given: str, why: str) -> None:
    """The host as Python's repr shows it (control characters escaped), its first 60 characters."""
    line = _refused("-H", given, "--dry-run", "/bin/true")
    host = next(h for h in (given.split(",") if "[" not in given else ["node0x;"]) if h != "n0")
    shown = host if len(host) <= 60 else host[:60] + "..."
    assert f"names the host {shown!r}, which {why}" in line, line


def test_a_job_with_such_a_host_starts_nothing(tmp_path: Path) -> None:
    """Not a dry run: refused before mpiexec, ssh or the host's shell could run what it holds."""
    line = _refused("-H", "n0,n1;touch made", "--num-instances", "2", "/bin/true", cwd=tmp_path)
    assert line == "host list 'n0,n1;touch made' names the host 'n1;touch made', which holds ';'; "
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("variable,text", [
    ("--host-file", "n0 slots=2\n-oProxyCommand=sh slots=2\n"),
    ("SLURM_JOB_NODELIST", "n[0-1],-oProxyCommand=sh"),
    ("PBS_NODEFILE", "n0\nn0\n-oProxyCommand=sh\n"),
    ("LSB_DJOB_HOSTFILE", "n0\n-oProxyCommand=sh\n"),
    ("LSB_MCPU_HOSTS", "n0 2 -oProxyCommand=sh 2"),
    ("PE_HOSTFILE", "n0 2 all.q@n0 UNDEFINED\n-oProxyCommand=sh 2 all.q UNDEFINED\n"),
    ("OMPI_MCA_orte_default_hostfile", "w0 slots=2\n-oProxyCommand=sh slots=2\n"),
    ("HYDRA_HOST_FILE", "w0:2\n-oProxyCommand=sh:2\n"),
    ("--host-discovery-script", "#!/bin/sh\necho n0\necho -oProxyCommand=sh:2\n"),
])
def test_every_source_is_checked_the_same_way(tmp_path: Path, variable: str, text: str) -> None:
    is_file = "\n" in text
    path = tmp_path / "hosts"
    path.write_text(text)
    path.chmod(0o755)
    value = str(path) if is_file else text
    args, env = ([variable, value], None) if variable.startswith("--") else ([], {variable: value})
    line = _refused(*args, "--num-instances", "2", "--dry-run", "/bin/true", env=env)
    source = {"--host-file": f"host file {value!r}", "--host-discovery-script": f"--host-discovery-script {value}",
              "LSB_MCPU_HOSTS": "LSB_MCPU_HOSTS"}.get(variable, f"{variable} file {value!r}" if is_file
                                                         else f"{variable} {value!r}")
    assert line == (f"{source} names the host '-oProxyCommand=sh', which begins with '-' (ssh and mpiexec would "
                    "read it as an option); "), line


@pytest.mark.parametrize("given,hosts", [
    ("node0", "node0"), ("n[0-1]", "n0:1,n1"), ("job-worker-0.job-worker.ns.svc", "job-worker-0.job-worker.ns.svc"),
    ("10.0.0.1", "10.0.0.1"), ("root@node0", "root@node0"),
    ("first.last@n-1.example.org", "first.last@n-1.example.org"),
    ("proj_web_1", "proj_web_1"), ("n0.example.org.", "n0.example.org."), ("x" * 63, "x" * 63),
])
def test_host_names_are_still_given_to_mpiexec(given: str, hosts: str) -> None:
    result = poprun("-H", given, "--num-instances", str(hosts.count(",") + 1), "--dry-run", "/bin/true")
    assert result.returncode == 0, result.stderr
    assert f" -hosts {hosts}:1 " in result.stdout


def test_a_host_files_bad_pattern_names_the_file_and_its_line(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("n0\n\x1b]0;title\x07n1\n")
    result = poprun("--host-file", str(path), "--num-instances", "2", "/bin/true")
    assert (result.returncode, result.stderr) == (2, (
        f"poprun: error: host file '{path}' line 2: host list '\\x1b]0;title\\x07n1' has unbalanced brackets\n"))
