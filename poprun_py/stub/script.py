"""The Python stub's entry: ``python -S poprun_py/stub/script.py INDEX`` (see ``fallback``).

Kept to these lines because a script is compiled on every run, while the stub's modules are
imported from their cached bytecode.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from poprun_py.stub.fallback import main

# os._exit: the stub writes through raw descriptors only, so the interpreter's teardown has
# nothing to flush.
os._exit(main())
