"""Horovod's runner utilities that programs import."""
