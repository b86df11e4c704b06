"""Horovod's API over the MPI world poprun (or mpiexec, or srun) starts.

Horovod's last release does not build against today's torch; its programs run here unchanged:
``import popdist_py.horovod.torch as hvd``, or ``import horovod.torch as hvd`` under
``poprun --horovod`` (which never hides a Horovod that is really installed). The layout mirrors
Horovod's (``common``, ``torch``, ``torch.mpi_ops``, ``torch.compression``, ``torch.elastic``) so
that every module path Horovod code imports from exists.
"""
