"""The one error type the planning layer raises; the CLI turns it into a usage error (exit 2)."""


class PlanError(ValueError):
    """An invalid job description; the message names the value and what would be valid."""
