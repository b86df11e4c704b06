"""Suite-wide reporting: tests that could not run here say so in one loud line at the end."""

from __future__ import annotations

import pytest

#: Skip reasons that start with this are not quiet: the summary repeats them in red.
LOUD = "MULTI-HOST TESTS NOT RUN"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reasons = set()
    for report in terminalreporter.stats.get("skipped", []):
        text = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if LOUD in text:
            reasons.add(text[text.index(LOUD):])
    for reason in sorted(reasons):
        terminalreporter.write_line(f"!!! {reason} !!!", red=True, bold=True)
