"""The front door and the docs stay true: links resolve, the Open MPI recipe runs as written,
the README stays short, and no doc quotes a test count (they go stale)."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.helpers import ROOT, SUBPROCESS_TIMEOUT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_names_a_file_that_exists() -> None:
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def test_the_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text


def test_no_doc_quotes_a_test_count() -> None:
    for doc in DOCS:
        assert not re.search(r"\b\d[\d,]* (?:tests|test cases)\b", doc.read_text()), doc.name


@pytest.mark.slow  # starts poprun
def test_the_open_mpi_recipe_runs_as_written() -> None:
    text = (ROOT / "docs" / "launcher.md").read_text()
    block = text.split("runs this block as written", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    done = subprocess.run(["bash", "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[0] [2.]", "[1] [2.]"]


def _design_section(start: str) -> str:
    text = (ROOT / "docs" / "design.md").read_text()
    begin = text.index(start)
    return text[begin:text.index("\n## ", begin + 1) if "\n## " in text[begin + 1:] else len(text)]


@pytest.mark.parametrize("package, section", [
    ("poprun_py", "One job, through the sub-packages of `poprun_py`"),  # the launcher, by process
    ("popdist_py", "## Repository layout"),
    ("popcontract", "## Repository layout"),
])
def test_the_design_names_every_module_of_the_tree(package: str, section: str) -> None:
    # docs/design.md's layout is the newcomer's map of the tree: a module it does not name is one
    # the map leaves out (a private one too: the map says which process and level it is in).
    text = _design_section(section)
    missing = [str(path.relative_to(ROOT)) for path in sorted((ROOT / package).rglob("*.py"))
               if path.name != "__init__.py" and not re.search(rf"\b{re.escape(path.stem)}\b", text)]
    assert not missing, f"docs/design.md does not name {missing}"
