"""The parts together: examples, torch, several hosts, the package, the docs, the bench, the layout."""
