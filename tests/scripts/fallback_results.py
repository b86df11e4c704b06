"""Print what the parts with a fallback compute, as hashes of the exact bytes: the shuffled
samplers' orders (``_swaps``) and reductions of gradients in pieces (``_tree``), and first which
of the two this process has. Run once with the compiled parts and once without them: the hash
lines must be the same.

    fallback_results.py
"""

import hashlib

import numpy as np

from popcontract import compiled
from popdist_py.data import shard_indices, torch_randperm
from popdist_py.engine._collectives.reduce import Program
from popdist_py.engine._collectives.segments import Segments

print(f"{compiled.SWAPS} {compiled.present(compiled.SWAPS)}")
print(f"{compiled.TREE} {compiled.present(compiled.TREE)}")

for n, seed in ((2, 0), (3, 5), (1000, 7), (100_003, -3), (1_000_000, 2**64 - 1)):
    print(f"randperm {n} {seed} {hashlib.sha256(torch_randperm(n, seed).tobytes()).hexdigest()}")
for shards, index, epoch in ((2, 0, 0), (2, 1, 0), (3, 2, 4), (8, 5, 1)):
    order = shard_indices(60_001, shards, index, shuffle=True, seed=11, epoch=epoch)
    print(f"shard {shards} {index} {epoch} {hashlib.sha256(order.tobytes()).hexdigest()}")

rng = np.random.default_rng(41)
sizes = [1, 7, 300, 2048, 2049, 5, 0, 70_000, 13]  # around the kernel's chunk of 2048 elements, and empty
for dtype in (np.float32, np.float64):
    for members in (2, 3, 5, 6):
        packed = [(rng.standard_normal(sum(sizes)) * 10.0 ** rng.integers(-6, 7, sum(sizes))).astype(dtype)
                  for _ in range(members)]
        packed[0][:4] = np.array([np.nan, np.inf, -0.0, np.finfo(dtype).max], dtype)
        cut = [Segments(np.split(p, np.cumsum(sizes)[:-1]), dtype) for p in packed]
        program = Program((0, members), [(k, k + 1) for k in range(members)])
        for divide_by in (0, members):
            for inputs in (packed, cut):
                out = program.run_blocked(inputs, np.add, np.empty_like(packed[0]), divide_by)
                layout = "pieces" if inputs is cut else "arrays"
                print(f"tree {np.dtype(dtype).name} {members} {divide_by} {layout} "
                      f"{hashlib.sha256(out.tobytes()).hexdigest()}")
