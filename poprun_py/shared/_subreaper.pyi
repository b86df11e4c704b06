def become() -> bool:
    """Make this process the subreaper of its descendants; whether this system can."""
