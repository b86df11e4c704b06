"""bench/horovod_suite.py's parts that need no Horovod: the MNIST files, reading outcomes from junit
files and verbose logs, the report and its doc section, and taking files from a git directory or a
checkout (a made-up tree here: Horovod's own files are never in this repository)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import horovod_source, horovod_tests
from bench.horovod_report import DOC_SECTION, doc_section, markdown
from bench.mnist_idx import BOX, SIDE, write_mnist
from bench.report import DOC_BEGIN, DOC_END, write_doc

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="test.parallel.test_torch.TorchTests" name="test_ok" time="0.1" />
<testcase classname="test.parallel.test_torch.TorchTests" name="test_bad" time="0.1">
  <failure message="ValueError: wrong&#10;second line">trace</failure></testcase>
<testcase classname="test.parallel.test_torch.TorchTests" name="test_gpu" time="0.0">
  <skipped type="pytest.skip" message="No GPUs available">why</skipped></testcase>
<testcase classname="test.parallel.test_torch.TorchTests" name="test_slow" time="120">
  <failure message="Failed: Timeout &gt;120.0s">dump</failure></testcase>
<testcase classname="test.parallel.test_torch.TorchTests" name="test_teardown" time="0.1">
  <error message="failed on teardown with &quot;OSError: gone&quot;">trace</error></testcase>
</testsuite></testsuites>
"""

LOG = """collecting ... collected 4 items

test/parallel/test_torch.py::TorchTests::test_ok PASSED                      [ 25%]
test/parallel/test_torch.py::TorchTests::test_bad FAILED                     [ 50%]
test/parallel/test_torch.py::TorchTests::test_gpu SKIPPED (No GPUs)          [ 75%]
test/parallel/test_torch.py::TorchTests::test_slow {}"""

DUMP = """+++++++++++++++++++ Timeout +++++++++++++++++++
~~~~~~~~~~~~~~~~~~~~ Stack of MainThread (1) ~~~~~~~~~~~~~~~~~~~~~
  File "/x/test/parallel/test_torch.py", line 40, in test_slow
    hvd.allreduce(t)
  File "/x/popdist_py/horovod/common/runtime.py", line 7, in wait
    event.wait()
~~~~~~~~~~~~~~~~~~~~ Stack of Thread-1 (2) ~~~~~~~~~~~~~~~~~~~~~
  File "/x/threading.py", line 1, in run
+++++++++++++++++++ Timeout +++++++++++++++++++
"""


def test_the_mnist_files_are_where_torchvision_looks_in_idx_with_digits_centred(tmp_path: Path) -> None:
    counts = write_mnist(tmp_path)
    raw = tmp_path / "MNIST" / "raw"
    assert counts["train"] + counts["test"] == 1797 and counts["test"] > 0
    for split, n in (("train", counts["train"]), ("t10k", counts["test"])):
        images = (raw / f"{split}-images-idx3-ubyte").read_bytes()
        labels = (raw / f"{split}-labels-idx1-ubyte").read_bytes()
        assert images[:16] == bytes([0, 0, 8, 3]) + n.to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
        assert labels[:8] == bytes([0, 0, 8, 1]) + n.to_bytes(4, "big")
        pixels = np.frombuffer(images[16:], np.uint8).reshape(n, SIDE, SIDE)
        margin = (SIDE - BOX) // 2
        assert pixels.max() == 255 and not pixels[:, :margin].any() and not pixels[:, -margin:].any()
        assert set(np.frombuffer(labels[8:], np.uint8)) == set(range(10))


def test_a_junit_file_gives_each_outcome_and_the_first_line_of_its_reason(tmp_path: Path) -> None:
    (tmp_path / "rank-0.xml").write_text(JUNIT)
    outcomes, reasons = horovod_tests.read_junit(tmp_path / "rank-0.xml")
    assert outcomes == {"TorchTests::test_ok": "passed", "TorchTests::test_bad": "failed",
                        "TorchTests::test_gpu": "skipped", "TorchTests::test_slow": "hung",
                        "TorchTests::test_teardown": "failed"}
    assert reasons["TorchTests::test_bad"] == "ValueError: wrong"
    assert reasons["TorchTests::test_gpu"] == "No GPUs available"
    assert reasons["TorchTests::test_teardown"].startswith("error in setup or teardown: failed on teardown")


@pytest.mark.parametrize("tail, timed_out, outcome, reason", [
    (DUMP, False, "hung", "the main thread in wait (/x/popdist_py/horovod/common/runtime.py:7)"),
    ("", True, "hung", "still running when the job's timeout struck"),
    ("\nSegmentation fault", False, "failed", "the instance ended during it: Segmentation fault"),
])
def test_a_log_without_junit_gives_the_ended_tests_and_the_one_it_stopped_in(
        tmp_path: Path, tail: str, timed_out: bool, outcome: str, reason: str) -> None:
    (tmp_path / "rank-0.log").write_text(LOG.format(tail))
    outcomes, reasons = horovod_tests.read_log(tmp_path / "rank-0.log", timed_out)
    assert outcomes == {"TorchTests::test_ok": "passed", "TorchTests::test_bad": "failed",
                        "TorchTests::test_gpu": "skipped", "TorchTests::test_slow": outcome}
    assert reasons["TorchTests::test_slow"].endswith(reason)


def test_counts_are_instance_0s_and_outcomes_that_differ_are_listed(tmp_path: Path) -> None:
    (tmp_path / "rank-0.log").write_text(LOG.format(DUMP))  # instance 0 wrote no junit file
    (tmp_path / "rank-1.xml").write_text(JUNIT)
    found = horovod_tests.collate(tmp_path, 2, timed_out=False)
    assert found["read_from"] == ["log", "junit"] and found["collected"] == 4
    assert found["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "hung": 1, "not_run": 1}
    assert found["outcomes"]["TorchTests::test_teardown"] == "not_run"
    assert found["differs"] == {"TorchTests::test_teardown": {"0": "not_run", "1": "failed"}}
    # tests that no instance reached are counted from what pytest collected
    (tmp_path / "rank-0.log").write_text(LOG.replace("collected 4", "collected 7").format(DUMP))
    assert horovod_tests.collate(tmp_path, 2, timed_out=False)["counts"]["not_run"] == 3


def _results() -> dict[str, Any]:
    run = {"command": "poprun ...", "exit_status": 1, "timed_out": False, "wall_s": 40.0,
           "counts": {"passed": 1, "failed": 1, "skipped": 0, "hung": 0, "not_run": 0},
           "outcomes": {"TorchTests::test_ok": "passed", "TorchTests::test_bad": "failed"},
           "reasons": {"TorchTests::test_bad": "ValueError: a | b"}, "differs": {}}
    example = {"example": "examples/pytorch/pytorch_mnist.py", "instances": 2, "exit_status": 0, "wall_s": 12.0,
               "command": "poprun x.py examples/pytorch/pytorch_mnist.py --epochs 1", "result": "Accuracy: 80%",
               "timed_out": False, "last_lines": []}
    return {"machine": {"date": "2026-12-07", "commit": "abc", "cores": 2, "cpu": "CPU", "mpi_library": "MPICH",
                        "python": "3.11"},
            "horovod": {"source": "/h", "commit": "0123456789abcdef"}, "torch": "2.13.0+cpu",
            "torchvision": {"version": "0.28.0", "compiled_ops": False},
            "suite": {"file": "test/parallel/test_torch.py", "pytest_options": ["-v"], "runs": {"2": run}},
            "examples": {"mnist_images": {"train": 10, "test": 2}, "runs": [example]}}


def test_the_report_has_the_counts_each_test_that_did_not_pass_and_the_examples() -> None:
    table = markdown(_results())
    assert "| 2 | 1 | 1 | 0 | 0 | 0 | 40 | 1 |" in table
    assert "| `TorchTests::test_bad` | failed | ValueError: a \\| b |" in table
    assert "| pytorch_mnist.py `--epochs 1` | 2 | 0 | 12 | Accuracy: 80% |" in table
    assert "0123456789ab" in table and "compiled ops do not load" in table


def test_the_doc_section_is_filled_and_the_rest_of_the_doc_kept(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{DOC_BEGIN.format(DOC_SECTION)}\nold\n{DOC_END.format(DOC_SECTION)}\nafter\n")
    assert write_doc(doc, {}, {DOC_SECTION: doc_section(_results(), doc)}) == [DOC_SECTION]
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith(f"{DOC_END.format(DOC_SECTION)}\nafter\n")
    assert "old" not in text and "| `TorchTests::test_bad` |" in text


def _made_up_tree(folder: Path) -> None:
    for name in horovod_source.FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"# {name}\n")
    (folder / "horovod").mkdir()
    (folder / "horovod" / "__init__.py").write_text("")


@pytest.mark.slow
def test_the_files_come_from_a_git_directory_or_a_checkout_and_never_the_horovod_package(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    _made_up_tree(tree)
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    for source in (tree / ".git", tree):
        into = tmp_path / f"into-{source.name}"
        into.mkdir()
        assert horovod_source.extract(source, into) == head
        assert sorted(str(p.relative_to(into)) for p in into.rglob("*") if p.is_file()) == sorted(
            horovod_source.FILES)
    (tmp_path / "empty").mkdir()
    with pytest.raises(horovod_source.SourceError, match="neither a Horovod checkout"):
        horovod_source.extract(tmp_path / "empty", tmp_path)
