"""The one error type the planning layer raises (the CLI turns it into a usage error, exit 2), and
how another program's words are quoted in poprun's own lines."""


class PlanError(ValueError):
    """An invalid job description; the message names the value and what would be valid."""


def printable(text: str) -> str:
    """``text`` (what an agent, ssh, mpiexec or a program said) with each character that is not
    printable written as ``repr`` writes it (ESC as ``\\x1b``, NUL ``\\x00``, CR ``\\r``, U+202E
    ``\\u202e``): quoted raw in poprun's lines, such characters would move the terminal's cursor,
    retitle or clear it, or end the line where poprun's message goes on."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def printable_lines(text: str) -> list[str]:
    """``text``'s lines, each ``printable`` and without its trailing white space (a CRLF's CR):
    split at newlines only, so that a carriage return or another of the breaks ``str.splitlines``
    knows stays in its line, where it is quoted, instead of hiding what came before it."""
    return [printable(line.rstrip()) for line in text.split("\n")]
