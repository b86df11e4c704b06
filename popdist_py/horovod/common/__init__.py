"""What Horovod's frameworks share: start and stop, process sets, the op negotiation, errors."""
