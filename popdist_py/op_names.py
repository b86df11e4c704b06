"""The two spellings of the reduction ops, defined once for both layers.

Host collectives speak numpy's and MPI's language (``sum``, ``prod``), the engine PopXL's
(``add``, ``mul``). Both layers accept either spelling and turn it into their own.
"""

from __future__ import annotations

#: (host collectives' name, engine's name) of each op spelt differently in the two layers.
SYNONYMS = (("sum", "add"), ("prod", "mul"))
TO_ENGINE = dict(SYNONYMS)
TO_HOST = {engine: host for host, engine in SYNONYMS}
