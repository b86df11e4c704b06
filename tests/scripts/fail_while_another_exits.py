"""Instance 0 fails (exit status 3) while instance 1 is in some state, each step ordered by what
poprun saw, not by a race: instance 0 waits until poprun has written instance 1's line WORDS to its
log (``--log-dir LOG_DIR``), which poprun has from instance 1's stub, which had read it.

``fail_while_another_exits.py LOG_DIR MODE``:

- MODE ``traceback``: instance 1 raises ``ValueError: failed as well`` (uncaught): Python prints
  its traceback, then runs its atexit hooks, where it lingers, as a clean-up may, until poprun's
  stop ends it (issue 49). Instance 0 waits for that exception's line.
- MODE ``running``: instance 1 writes ``instance 1 runs`` to stderr and waits to be stopped.
- MODE ``raises-on-stop``: as ``running``, but its SIGTERM handler raises: Python prints that
  traceback after the stop, then the program ends as SIGTERM ends one.
"""

import atexit
import os
import signal
import sys
import time

HOLD_SECONDS = 60
WORDS = {"traceback": "ValueError: failed as well", "running": "instance 1 runs", "raises-on-stop": "instance 1 runs"}


def logged(folder: str, words: str) -> bool:
    """Whether poprun's log of an instance (``stderr.log``, or ``output.log`` for one stream) has ``words``."""
    for name in ("stderr.log", "output.log"):
        try:
            with open(os.path.join(folder, name)) as log:
                if words in log.read():
                    return True
        except FileNotFoundError:
            pass
    return False


def raise_on_stop(*_: object) -> None:
    """SIGTERM's handler: raise, and end as SIGTERM ends a program once Python has printed the traceback."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    atexit.register(os.kill, os.getpid(), signal.SIGTERM)
    raise RuntimeError("raised on the stop")


def main() -> None:
    log_dir, mode = sys.argv[1], sys.argv[2]
    if os.environ["RANK"] == "0":
        deadline = time.monotonic() + HOLD_SECONDS
        while not logged(os.path.join(log_dir, "instance-1"), WORDS[mode]):
            if time.monotonic() > deadline:
                sys.exit(9)
            time.sleep(0.005)
        sys.exit(3)
    if mode == "traceback":
        atexit.register(time.sleep, HOLD_SECONDS)
        raise ValueError("failed as well")
    if mode == "raises-on-stop":
        signal.signal(signal.SIGTERM, raise_on_stop)
    print(WORDS[mode], file=sys.stderr, flush=True)
    time.sleep(HOLD_SECONDS)


if __name__ == "__main__":
    main()
