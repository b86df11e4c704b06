"""``python -m popdist_py``: the version, and which compiled parts this install has (one line each:
present, or missing and what that means), for a user who installed the library without poprun's
command line in mind, or on a machine without a C compiler."""

from popcontract import __version__, compiled

print("\n".join([f"poprun-py {__version__}", *compiled.report()]))
