"""How far a host's wall clock is from poprun's, measured over its control connection, so that
the times hosts' supervisors send (when a program ended, when its error file was written) can
be compared with each other and with poprun's own.

One exchange, as NTP does it: poprun sends the nonce at ``t0`` (its clock), the host's supervisor receives it at
``t1`` and sends CLOCK at ``t2`` (its clock), poprun receives that at ``t3``. The host's clock is
``((t1 - t0) + (t2 - t3)) / 2`` ahead of poprun's, give or take half the round trip's time on the
wire, ``((t3 - t0) - (t2 - t1)) / 2``. A measured offset within that error is no offset: clocks that
agree as far as can be told (one host, or hosts kept in step by NTP) are taken as one.
"""

from __future__ import annotations


def offset_ns(sent: int, arrived: int, replied: int, received: int) -> int:
    """The host's clock minus poprun's (ns): ``sent`` and ``received`` on poprun's clock, when the
    nonce went out and the host's CLOCK came in; ``arrived`` and ``replied`` on the host's, when the
    nonce came in and CLOCK went out. 0 when the offset is within the measure's error."""
    offset = ((arrived - sent) + (replied - received)) // 2
    error = max(0, (received - sent) - (replied - arrived)) // 2
    return 0 if abs(offset) <= error else offset
