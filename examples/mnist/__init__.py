"""The modules of ``examples/mnist_rts.py`` and ``examples/mnist_pipeline.py``: MNIST with
replication, RTS and pipelining on popdist_py.engine's Trainer.

- ``idx``: the MNIST IDX file format, read and validated (and written, for tests and tools).
- ``datasets``: MNIST from IDX files or scikit-learn's bundled digits; per-epoch ``[A, L, B]`` batches.
- ``model``: the two-layer network's forward and backward pass in numpy, every sum a fixed tree,
  made of the two layers' functions.
- ``stages``: those layer functions as two pipeline stages, one device each.
- ``trainer``: the flags as an optimizer and PopART's tensor location settings; the engine's Trainer.
- ``checkpoint``: ``Trainer.save``/``load`` (weights, optimizer state, update count) plus the epoch counter.
"""
