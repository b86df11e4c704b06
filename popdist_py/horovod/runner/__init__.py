"""Horovod's runner: here only the helpers Horovod programs and tests import (``util.threads``);
jobs are started by ``poprun``."""
