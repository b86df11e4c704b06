"""The reduction ops' names, defined once for both layers.

Host collectives speak numpy's and MPI's language (``sum``, ``prod``), the engine PopXL's
(``add``, ``mul``). Both layers accept either spelling and turn it into their own. The engine
also has PopXL's other CollectiveOperator names: ``square_add`` and the logical ``and``/``or``.
"""

from __future__ import annotations

#: (host collectives' name, engine's name) of each op spelt differently in the two layers.
SYNONYMS = (("sum", "add"), ("prod", "mul"))
TO_ENGINE = dict(SYNONYMS)
TO_HOST = {engine: host for host, engine in SYNONYMS}

#: The engine's arithmetic ops (PopXL's names): any numeric dtype; ``mean`` needs floating point.
ARITHMETIC = ("add", "mean", "mul", "min", "max")
#: PopXL's SquareAdd: every member's input squared, then added (numeric, not bool).
SQUARE_ADD = "square_add"
#: PopXL's LogicalAnd and LogicalOr, which popops defines for bool operands only.
LOGICAL = ("and", "or")
#: Every op name the engine's collectives accept (besides the host spellings in :data:`TO_ENGINE`).
ENGINE_OPS = (*ARITHMETIC, SQUARE_ADD, *LOGICAL)
