"""What a host's supervisor tells each stub besides its program (``host.programs``): what the stub
used to change in its own environment, decided once per host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from popcontract import environment
from poprun_py.host.programs import HIDDEN, HostPrograms
from poprun_py.shared.cores import threads_per_instance
from poprun_py.shared.root_cause import error_file
from poprun_py.wire import local


def test_a_remote_host_reads_its_share_from_what_the_stub_that_started_it_inherited() -> None:
    programs = HostPrograms.from_environment({environment.LOCAL_WORLD_SIZE: "3",
                                              environment.TORCHELASTIC_ERROR_FILE: "/tmp/poprun-ab/error-4.json",
                                              environment.ONE_STREAM: "1", environment.HOST_SUBNET: "10.0.0.0/8"})
    assert (programs.per_host, programs.error_dir, programs.one_stream, programs.subnet) == (
        3, "/tmp/poprun-ab", True, "10.0.0.0/8")
    assert programs.error_file(5) == error_file("/tmp/poprun-ab", 5)
    plain = HostPrograms.from_environment({})
    assert (plain.per_host, plain.error_dir, plain.one_stream, plain.subnet) == (1, None, False, None)
    assert plain.error_file(0) is None


def test_instance_0_alone_keeps_stdin_and_one_stream_is_a_flag() -> None:
    assert HostPrograms(2, None, one_stream=False).flags(0) == 0
    assert HostPrograms(2, None, one_stream=True).flags(1) == local.PROGRAM_ONE_STREAM | local.PROGRAM_NO_STDIN


def test_the_program_never_sees_poprun_s_own_variables_and_gets_its_share_of_the_cores(tmp_path: Path) -> None:
    job = tmp_path / "poprun-job"
    job.mkdir(mode=0o700)
    Path(error_file(str(job), 2)).write_text("{}")  # an earlier start's
    changes, path = HostPrograms(4, str(job), one_stream=False).environment(2, {})
    assert path == error_file(str(job), 2) and list(job.iterdir()) == []  # the old file gone, nothing made
    assert {name: changes[os.fsencode(name)] for name in HIDDEN} == dict.fromkeys(HIDDEN)
    assert changes[environment.OMP_NUM_THREADS.encode()] == str(threads_per_instance(4)).encode()
    mine, _ = HostPrograms(4, None, one_stream=False).environment(0, {environment.OMP_NUM_THREADS: "3"})
    assert environment.OMP_NUM_THREADS.encode() not in mine  # the user's stands


def test_an_error_file_that_cannot_be_had_is_unset_with_one_warning(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # the job's folder is a file: nothing can be made below it
    changes, path = HostPrograms(1, str(blocked), one_stream=False).environment(0, {})
    assert path is None and changes[environment.TORCHELASTIC_ERROR_FILE.encode()] is None
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and f"no {environment.TORCHELASTIC_ERROR_FILE} for instance 0: " in warning
