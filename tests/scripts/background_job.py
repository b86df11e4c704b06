"""A shell's part in ``poprun ... &``: made the leader of a session whose controlling terminal is
its stdin (the test gives it a pseudo-terminal), it starts ARGV as a background job (a process
group of its own, the terminal as its stdin, stdout and stderr), outlives the terminal's hangup
(SIGHUP handled, as a shell whose job was disowned; the job gets the default back at exec), and
exits with the job's status (128 + N for signal N)."""

import fcntl
import signal
import subprocess
import sys
import termios

signal.signal(signal.SIGHUP, lambda _signum, _frame: None)
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
job = subprocess.Popen(sys.argv[1:], process_group=0)
status = job.wait()
sys.exit(128 - status if status < 0 else status)
