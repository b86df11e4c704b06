"""Config files: --export-config writes the effective options, --import-config makes a file the
defaults, so whatever the command line gives wins; a bad file is one clear line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import poprun

pytestmark = pytest.mark.slow  # every test starts poprun


def _effective(tmp_path: Path, *argv: str) -> dict[str, Any]:
    """The options poprun runs with for ``argv`` (as --export-config writes them)."""
    out = tmp_path / "effective.json"
    result = poprun("--dry-run", "--export-config", str(out), "--overwrite-config", *argv, "/bin/true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    effective: dict[str, Any] = json.loads(out.read_text())
    return effective


def test_config_round_trip(tmp_path: Path) -> None:
    config = tmp_path / "job.json"
    first = poprun("--dry-run", "--num-instances", "2", "--num-replicas", "6", "--print-topology", "yes",
                   "--mpi-local-args", "-env A 1", "--instance-mpi-local-args", "1:-env B 2",
                   "--export-config", str(config), "/bin/true")
    assert first.returncode == 0, first.stderr
    data = json.loads(config.read_text())
    assert data["num-instances"] == 2 and data["num-replicas"] == 6 and data["print-topology"] is True
    assert data["instance-mpi-local-args"] == ["1:-env B 2"] and data["host"] is None
    assert not {"dry-run", "export-config", "import-config", "overwrite-config"} & set(data)
    again = poprun("--dry-run", "--import-config", str(config), "/bin/true")
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    # Refuses to overwrite unless asked.
    refused = poprun("--dry-run", "--export-config", str(config), "/bin/true")
    assert refused.returncode == 2 and "already exists; add --overwrite-config" in refused.stderr
    replaced = poprun("--dry-run", "--export-config", str(config), "--overwrite-config", "/bin/true")
    assert replaced.returncode == 0 and json.loads(config.read_text())["num-instances"] == 1


FILE = {"num-instances": 4, "num-replicas": 8, "print-topology": "yes", "verbose": 1, "mpi-local-args": "-env A 1",
        "instance-mpi-local-args": ["0:-env B 2", "1:-env C 3"], "executable-cache-path": "/cache"}


@pytest.mark.parametrize("argv,expected", [
    # Nothing given: every value comes from the file, converted by the option's own type.
    ([], {**FILE, "print-topology": True}),
    # Each value given on the command line wins over the file's; the rest still come from the file.
    (["--num-instances", "2", "--num-replicas=2"], {**FILE, "num-instances": 2, "num-replicas": 2,
                                                     "print-topology": True}),
    (["--print-topology", "no", "-vv"], {**FILE, "print-topology": False, "verbose": 2}),
    # A repeatable option given on the command line replaces the file's list (it is not appended to).
    (["--instance-mpi-local-args", "1:-env D 4"], {**FILE, "print-topology": True,
                                                   "instance-mpi-local-args": ["1:-env D 4"]}),
], ids=["file only", "integers", "yes-no and count", "repeatable"])
def test_command_line_wins_over_the_imported_file(tmp_path: Path, argv: list[str], expected: dict[str, object]) -> None:
    config = tmp_path / "job.json"
    config.write_text(json.dumps(FILE))
    # Where --import-config stands does not matter: it is read before every other option.
    first = _effective(tmp_path, "--import-config", str(config), *argv)
    last = _effective(tmp_path, *argv, "--import-config", str(config))
    assert first == last
    assert {key: first[key] for key in expected} == expected


def test_null_in_a_file_means_the_default(tmp_path: Path) -> None:
    config = tmp_path / "job.json"
    config.write_text('{"num-instances": null, "num-replicas": null, "verbose": null, "numa-aware": null, '
                      '"instance-mpi-local-args": null}')
    assert _effective(tmp_path, "--import-config", str(config)) == _effective(tmp_path)


def test_vipu_options_from_a_file_are_warned_about(tmp_path: Path) -> None:
    config = tmp_path / "job.json"
    config.write_text('{"vipu-partition": "p1"}')
    result = poprun("--import-config", str(config), "/bin/echo", "ran")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[0] ran\n" and "--vipu-partition has no effect" in result.stderr


@pytest.mark.parametrize("content,message", [
    ('{"num-instance": 2}', ("Invalid value for '--import-config': '{path}' has unknown option(s) 'num-instance'; "
                             "known options are: error-file, executable-cache-path, horovod, host, ")),
    ('{"dry-run": true}', "has unknown option(s) 'dry-run'"),
    ('{"num-instances": "two"}', "config file '{path}': 'num-instances': 'two' is not a whole number in plain decimal"),
    ('{"num-instances": "2_0"}', "config file '{path}': 'num-instances': '2_0' is not a whole number in plain decimal"),
    ('{"num-instances": 2.5}', "config file '{path}': 'num-instances': 2.5 is not a whole number"),
    ('{"num-replicas": true}', "config file '{path}': 'num-replicas': True is not a whole number"),
    ('{"num-instances": 1000000000}',
     "config file '{path}': 'num-instances': 1000000000 is more than poprun can start (at most 65536)"),
    ('{"num-instances": 0}', "config file '{path}': 'num-instances': 0 is not in the range 1<=x<=65536"),
    ('{"print-topology": 3}', "config file '{path}': 'print-topology': 3 is not yes or no"),
    # A file's value is always the option's own (never the program): any other word is refused.
    ('{"tee": "maybe"}', "config file '{path}': 'tee': 'maybe' is not yes or no"),
    ('{"instance-mpi-local-args": "1:-x A"}',
     "'{path}': 'instance-mpi-local-args' must be a list of single values (the option is repeatable), got \"1:-x A\""),
    ('{"host": ["a", "b"]}', "'{path}': 'host' must be a single value, not a list or object, got [\"a\", \"b\"]"),
    # Text where a command line can only give text: a number or true is named, not a traceback (or a
    # host 1.5 dialled as 1.0.0.5); an empty name or a NUL byte is refused.
    ('{"log-dir": 5}', "config file '{path}': 'log-dir': 5 is not text (in a config file, give it in quotes)"),
    ('{"error-file": true}', "config file '{path}': 'error-file': True is not text (in a config file, give it"),
    ('{"host-file": 7}', "config file '{path}': 'host-file': 7 is not text"),
    ('{"host": 1.5}', "config file '{path}': 'host': 1.5 is not text"),
    ('{"mpi-global-args": 5}', "config file '{path}': 'mpi-global-args': 5 is not text"),
    ('{"instance-mpi-local-args": [0]}', "config file '{path}': 'instance-mpi-local-args': 0 is not text"),
    ('{"mpi": false}', "config file '{path}': 'mpi': False is not text"),
    ('{"log-dir": ""}', "config file '{path}': 'log-dir': '' is empty: give a name"),
    ('{"error-file": "a\\u0000b"}',
     "config file '{path}': 'error-file': 'a\\x00b' holds a NUL byte, which no argument or file name can carry"),
    ('{"executable-cache-path": "/x\\u0000"}', "'executable-cache-path': '/x\\x00' holds a NUL byte"),
    ('{"num-instances": 2, "num-instances": 4}',
     "Invalid value for '--import-config': '{path}' gives 'num-instances' more than once; give each option once"),
    ('[1, 2]', "Invalid value for '--import-config': '{path}' must hold a JSON object of option names to values"),
    ('{"num-instances": 2,', "Invalid value for '--import-config': '{path}' is not valid JSON: "),
])
def test_bad_config_files(tmp_path: Path, content: str, message: str) -> None:
    config = tmp_path / "bad.json"
    config.write_text(content)
    result = poprun("--import-config", str(config), "/bin/true")
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("poprun: error: "), result.stderr
    assert message.replace("{path}", str(config)) in lines[0]


@pytest.mark.parametrize("option", ["--error-file", "--log-dir", "--mpi", "--export-config", "--host-file"])
def test_an_empty_name_on_the_command_line_is_refused(option: str) -> None:
    result = poprun(option, "", "/bin/true")
    assert result.returncode == 2
    assert result.stderr == f"poprun: error: Invalid value for '{option}': '' is empty: give a name\n"


def test_a_bad_value_on_the_command_line_is_blamed_on_the_command_line(tmp_path: Path) -> None:
    config = tmp_path / "job.json"
    config.write_text('{"num-instances": 2}')
    result = poprun("--import-config", str(config), "--num-instances", "0", "/bin/true")
    assert result.returncode == 2
    assert result.stderr == "poprun: error: Invalid value for '--num-instances': 0 is not in the range 1<=x<=65536\n"


@pytest.mark.parametrize("name,content,message", [
    ("binary", bytes(range(256)) * 8, "is binary or UTF-16, not text: save it as UTF-8"),
    ("utf16", '{"num-instances": 2}'.encode("utf-16"), "is binary or UTF-16, not text: save it as UTF-8"),
    ("latin1", '{"host": "n\xe9"}'.encode("latin-1"), "is not UTF-8 text (byte 0xe9 at offset 11): save it as UTF-8"),
    ("deep", b"[" * 100_000, "nests lists or objects too deeply"),
    ("deep-value", b'{"host": ' + b"[" * 100_000, "nests lists or objects too deeply"),
    ("nested-list", b'{"instance-mpi-local-args": [["0:-x A"]]}', "must be a list of single values"),
    ("huge", b'{"host": "' + b"a" * (100 << 20) + b'"}', "is larger than 1 MiB"),
    ("empty", b"", "is empty; it must hold a JSON object"),
    ("dev-zero", None, "is larger than 1 MiB"),
    ("fifo", None, "is empty; it must hold a JSON object"),
])
def test_config_files_that_are_not_small_json_text(tmp_path: Path, name: str, content: bytes | None,
                                                   message: str) -> None:
    """Each is one line, quickly: the file is read up to 1 MiB + 1 byte, decoded as UTF-8, parsed
    without recursing without end; a FIFO nobody writes to reads as empty instead of blocking."""
    config = tmp_path / f"{name}.json"
    if name == "dev-zero":
        config.symlink_to("/dev/zero")
    elif name == "fifo":
        os.mkfifo(config)
    else:
        assert content is not None
        config.write_bytes(content)
    result = poprun("--import-config", str(config), "/bin/true", timeout=20)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert lines == [f"poprun: error: Invalid value for '--import-config': '{config}' {message}"] or (
        len(lines) == 1 and lines[0].startswith(f"poprun: error: Invalid value for '--import-config': '{config}'")
        and message in lines[0]), result.stderr[-2000:]
