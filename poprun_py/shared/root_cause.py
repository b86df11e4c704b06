"""torchrun's error files: where an instance's program records why it failed, and how that reaches poprun.

Every instance gets ``TORCHELASTIC_ERROR_FILE`` (``error_file``): ``DIR/error-<i>.json``, DIR one
directory per job on each host. torch's ``@record`` (``torch.distributed.elastic.multiprocessing.errors``)
writes the exception there as JSON: ``{"message": {"message": "ValueError: ...", "extraInfo":
{"py_callstack": "Traceback ...", "timestamp": "..."}}}`` (or ``{"message": "...", "timestamp": ...}``).

Each host's supervisor (poprun on its own host) has DIR before the program starts, and when the
program exits non-zero sends what the file says to poprun (``take``: ``collect``, at most
``SEND_LIMIT`` bytes), then removes it; DIR goes with the job's folder on each host. So poprun never
reads a remote host's disk. poprun turns what came (``describe``) into its failure summary and
``--error-file``'s ``root_cause``.

The hosts' side uses only ``os`` (``json`` only for a file too large to send whole).
"""

from __future__ import annotations

import os

#: The most bytes of an error file a host's supervisor sends: a traceback's worth, not a runaway file's.
SEND_LIMIT = 64 * 1024
#: The most it reads to cut a larger file down to SEND_LIMIT (keeping the traceback's end).
READ_LIMIT = 16 * 1024 * 1024
#: Lines of the traceback shown in poprun's summary (its end, where the error is).
SHOWN_TRACEBACK_LINES = 30


def error_file(directory: str, index: int) -> str:
    """Instance ``index``'s TORCHELASTIC_ERROR_FILE, in its job's ``directory``: a file, not a folder
    per instance, as one supervisor per host makes and removes them (no mkdir per instance)."""
    return f"{directory}/error-{index}.json"


# ---------------------------------------------------------------- a host's supervisor's side
def clear_old(path: str) -> str | None:
    """Remove an error file an earlier start left at ``path``; None, else why it could not be."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return f"cannot remove the old {path}: {exc.strerror or exc}"
    return None


def collect(path: str) -> bytes | None:
    """What the failed program wrote to its error file, at most SEND_LIMIT bytes; None when it wrote
    nothing. A larger file is cut: as JSON, the message and the traceback's end are kept."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(READ_LIMIT)
    except OSError:
        return None
    if not data:
        return None
    if len(data) <= SEND_LIMIT:
        return data
    import json

    try:
        record = json.loads(data)
        message, traceback, timestamp = _fields(record)
    except (ValueError, TypeError, AttributeError):
        return data[:SEND_LIMIT]
    keep = SEND_LIMIT // 2
    while keep > 64:
        cut = json.dumps({"message": message[:keep], "timestamp": timestamp,
                          "traceback": traceback if len(traceback) <= keep else "...\n" + traceback[-keep:]})
        if len(cut) <= SEND_LIMIT:  # ASCII: json.dumps escapes everything else
            return cut.encode()
        keep //= 2
    return data[:SEND_LIMIT]


def written_at(path: str) -> int:
    """When the error file was last written, on this host's clock (ns; 0 when it cannot be told):
    torch records the time of the failure in whole seconds; this refines it."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def take(path: str | None, failed: bool, keep: bool = False) -> tuple[bytes | None, int]:
    """What a failed program recorded in its error file at ``path`` (None: nothing, or it did not
    fail) and when it was written (ns; 0: never); the file is then removed, unless ``keep`` (on
    poprun's own host, where poprun removes the job's folder whole at the end and a restart removes
    an old file)."""
    if not path:
        return None, 0
    cause = collect(path) if failed else None
    recorded = written_at(path) if cause is not None else 0
    if not keep:
        remove(path)
    return cause, recorded


def remove(path: str, folders: int = 0) -> None:
    """Remove the error file (there or not), then up to ``folders`` of the folders above it, each
    while empty (the job's, by a stub whose supervisor died)."""
    try:
        os.unlink(path)
    except OSError:
        pass
    for _ in range(folders):
        path = os.path.dirname(path)
        try:
            os.rmdir(path)
        except OSError:
            return


# ---------------------------------------------------------------- poprun's side
def _fields(record: object) -> tuple[str, str, str | None]:
    """(message, traceback, timestamp) of an error file's JSON, in either of torch's layouts."""
    if not isinstance(record, dict):
        raise TypeError("not a JSON object")
    message = record.get("message")
    if isinstance(message, dict):  # ErrorHandler.record_exception's layout
        extra = message.get("extraInfo") or {}
        return (str(message.get("message", "")), str(extra.get("py_callstack") or ""),
                None if extra.get("timestamp") is None else str(extra["timestamp"]))
    # {"message": "...", "timestamp": ...}, and collect's cut form, which adds "traceback"
    return (str(message or ""), str(record.get("traceback") or ""),
            None if record.get("timestamp") is None else str(record["timestamp"]))


def describe(data: bytes) -> dict[str, str | None]:
    """``{"message", "traceback", "timestamp"}`` of what a host's supervisor sent; text that is not torch's JSON
    is kept as the message."""
    import json

    text = data.decode(errors="replace")
    try:
        message, traceback, timestamp = _fields(json.loads(text))
    except (ValueError, TypeError, AttributeError):
        return {"message": text.strip(), "traceback": None, "timestamp": None}
    return {"message": message, "traceback": traceback or None, "timestamp": timestamp}


def summary_lines(index: int, cause: dict[str, str | None]) -> list[str]:
    """The failure summary's lines for instance ``index``'s root cause: the message, then the end of
    the traceback, each ``printable``."""
    from poprun_py.shared.errors import printable_lines

    message = (cause["message"] or "").strip() or "(no message)"
    first, *rest = printable_lines(message)
    lines = [f"poprun: root cause (instance {index}'s error file): {first}"]
    lines += [f"    {line}" for line in rest[:SHOWN_TRACEBACK_LINES]]
    traceback = (cause["traceback"] or "").rstrip()
    traceback_lines = printable_lines(traceback) if traceback else []
    if traceback_lines:
        shown = traceback_lines[-SHOWN_TRACEBACK_LINES:]
        lines.append(f"poprun: its traceback{'' if len(shown) == len(traceback_lines) else ' (its end)'}:")
        lines += [f"    {line}" for line in shown]
    return lines
