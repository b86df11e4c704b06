"""``make sanitize``'s check before its tests run: every compiled part Python imports from the
current directory is that copy's build with AddressSanitizer and UndefinedBehaviorSanitizer, not
the venv's in-place one (with which the tests would pass and prove nothing). Exits 1 naming a
part that is not."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

#: The compiled parts with a Python entry point (poprun_py.shared._loopback is a preloaded library).
MODULES = ("popdist_py.engine._batch_invariant", "popdist_py.engine._collectives._tree", "popdist_py._swaps",
           "poprun_py.shared._subreaper")
#: Symbols only a build with each sanitizer calls.
MARKS = (b"__asan_report_", b"__ubsan_handle_")


def main() -> int:
    here = Path.cwd().resolve()
    for name in MODULES:
        path = Path(importlib.import_module(name).__file__ or "").resolve()
        built = path.read_bytes()
        if not path.is_relative_to(here) or not all(mark in built for mark in MARKS):
            print(f"make sanitize: {name} is {path}, not a sanitized build under {here}", file=sys.stderr)
            return 1
    print(f"make sanitize: {len(MODULES)} compiled parts built with ASan and UBSan under {here}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
