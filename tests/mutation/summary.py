"""The table of docs/mutation.md from a finished run: ``mutmut results --all true | python -m tests.mutation.summary``.

One row per mutated module, with how many of its mutants the tests killed (a timeout counts as
killed: the mutant hung a job), how many the type check caught before any test ran, how many
survived, and how many no selected test reached.
Modules the run left out (``make mutants`` or ``make mutants-launcher``) have no row.
"""

from __future__ import annotations

import collections
import re
import sys

COLUMNS = ("killed", "timeout", "caught by type check", "survived", "no tests", "not checked")


def main() -> None:
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in sys.stdin:
        match = re.match(r"\s*(\S+?)\.x[_ǁ]\S*: (.+)$", line)
        if match:
            counts[match.group(1)][match.group(2).strip()] += 1
    print("| module | mutants | " + " | ".join(c.replace("caught by ", "") for c in COLUMNS) + " |")
    print("|---|" + "---|" * (len(COLUMNS) + 1))
    total: collections.Counter[str] = collections.Counter()
    for module in sorted(counts):
        row = counts[module]
        if row["not checked"] == sum(row.values()):
            continue  # not in this run (make mutants or make mutants-launcher)
        total.update(row)
        print(f"| `{module}` | {sum(row.values())} | " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
    print(f"| all | {sum(total.values())} | " + " | ".join(str(total[c]) for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
