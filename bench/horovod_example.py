"""Run one of Horovod's example scripts unchanged, as ``python SCRIPT ARGS...`` would, in each instance.

    python -m bench.horovod_example SCRIPT [ARGS...]

Why not ``python SCRIPT`` itself: the examples import torchvision, and the only torchvision 0.28.0
wheel a package index without PyTorch's own serves is the CUDA build, whose compiled ops
(``torchvision/_C.so``) need ``libtorch_cuda.so``, which the CPU torch lacks. torchvision then
imports its models, datasets and transforms (pure Python) fine but for one line: it registers a
fake kernel for ``torchvision::nms`` without checking that its ops loaded, and fails. Where the ops
do not load, the schemas of ``nms`` and ``qnms`` (the C++ ones) are defined first, so that line
passes; any use of the ops themselves (detection models, not these examples) still fails.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import runpy
import sys

#: The ops torchvision registers fake kernels for without checking that its compiled ops loaded.
UNGUARDED_OPS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                 "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
#: The library defining them, kept for the life of the process: its definitions go when it is collected.
_kept: list[object] = []


def torchvision_ops_load() -> bool | None:
    """Whether torchvision's compiled ops load with this torch; None without torchvision (or its ops)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = [p for folder in spec.submodule_search_locations for p in glob.glob(os.path.join(folder, "_C*.so"))]
    if not found:
        return None
    import torch

    try:
        torch.ops.load_library(found[0])  # type: ignore[no-untyped-call]
    except OSError:
        return False
    return True


def let_torchvision_import() -> None:
    """Define the schemas torchvision's import needs where its compiled ops cannot define them."""
    if torchvision_ops_load() is not False:
        return
    import torch

    library = torch.library.Library("torchvision", "DEF")  # type: ignore[no-untyped-call]
    for schema in UNGUARDED_OPS:
        library.define(schema)  # type: ignore[no-untyped-call]
    _kept.append(library)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(f"usage: python -m bench.horovod_example SCRIPT [ARGS...]\n{__doc__}")
    script = os.path.abspath(sys.argv[1])
    let_torchvision_import()
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
