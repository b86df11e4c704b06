"""The modules of ``examples/mnist_rts.py``: MNIST with replication and RTS on popdist_py.engine.

- ``idx``: the MNIST IDX file format, read and validated (and written, for tests and tools).
- ``datasets``: MNIST from IDX files or scikit-learn's bundled digits; per-epoch replica batches.
- ``model``: the two-layer network's forward and backward pass in numpy.
- ``trainer``: the network's weights as engine variables (plain or RTS) and the replicated steps.
- ``checkpoint``: the engine's ``rt.save``/``rt.load`` plus the epoch counter, restorable under any split.
"""
