"""The folder poprun --horovod puts first on PYTHONPATH: it holds the one-file `horovod` package."""
