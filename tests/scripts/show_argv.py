"""Print the arguments this program received, exactly: each of sys.argv's bytes (os.fsencode
undoes Python's decoding) ended by NUL, the whole as one line of hex."""

import os
import sys

print(b"".join(os.fsencode(arg) + b"\0" for arg in sys.argv).hex())
