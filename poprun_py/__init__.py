"""poprun: launch data-parallel Python jobs on MPI, the way Graphcore's PopRun does.

Kept nearly import-free on purpose: the Python stub and each host's supervisor import this package with ``python -S``
and ``poprun``'s start-up time counts against every launch. The one import is the contract's
package, which imports nothing and which they load anyway.
"""

from popcontract import __version__ as __version__  # the distribution's one version
