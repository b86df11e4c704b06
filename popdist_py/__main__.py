"""``python -m popdist_py``: the version, and which compiled parts this install has (one line each:
present, or missing and what that means), for a user who installed the library without poprun's
command line in mind, or on a machine without a C compiler. ``--version`` says the same; any other
argument is refused (exit 2), so a mistyped option is never read as a question answered."""

import argparse

from popcontract import __version__, compiled

parser = argparse.ArgumentParser(prog="python -m popdist_py", allow_abbrev=False,
                                 description="Print popdist_py's version and which compiled parts this install has.")
parser.add_argument("--version", action="store_true", help="the same as no argument")
_, unknown = parser.parse_known_args()
if unknown:
    parser.error(f"{unknown[0]!r} is not an argument; it takes --version, -h/--help or none")
print("\n".join([f"poprun-py {__version__}", *compiled.report()]))
