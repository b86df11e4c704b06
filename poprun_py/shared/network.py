"""Which local address the instances (and MPI's own daemons) call back on.

A one-host job talks over loopback. As soon as one host is remote, loopback names are useless
to it (on many machines the hostname itself resolves to 127.0.0.1), so the address is either
the one in ``--host-subnet CIDR`` or, by default, the local address of the route towards the
first remote host: the address that host can reach us on.

Imported only when hosts are given, so a plain launch never pays for ``socket`` or ``ipaddress``.
"""

from __future__ import annotations

import ipaddress
import socket

from poprun_py.shared.errors import PlanError

#: Names that are this host whatever the network looks like.
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def local_addresses() -> dict[str, str]:
    """This host's IPv4 addresses, each with its interface name (Linux: SIOCGIFADDR)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), siocgifaddr, request)
            except OSError:
                continue  # no IPv4 address on this interface
            found[socket.inet_ntoa(reply[20:24])] = name
    return found


def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return [str(info[4][0]) for info in infos]


def is_local_name(host: str) -> bool:
    """Whether ``host`` names this machine without asking a resolver: a loopback name or address,
    or this host's own name."""
    if host in LOOPBACK_NAMES or host == socket.gethostname():
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local(host: str, addresses: dict[str, str] | None = None) -> bool:
    """Whether ``host`` is this machine: by name, or by resolving to only this machine's addresses."""
    if is_local_name(host):
        return True
    resolved = _resolve(host)
    if not resolved:
        return False  # unknown here: treated as remote, and its launcher (ssh, an agent) names the problem
    addresses = local_addresses() if addresses is None else addresses
    return all(ipaddress.ip_address(a).is_loopback or a in addresses for a in resolved)


def address_towards(host: str) -> str | None:
    """The local address of the route towards ``host`` (a UDP connect sends nothing), or None
    when ``host`` does not resolve or no route leads there."""
    for address in _resolve(host):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((address, 9))
            except OSError:
                continue
            return str(probe.getsockname()[0])
    return None


def parse_subnet(cidr: str) -> ipaddress.IPv4Network:
    """``--host-subnet``'s value as a network; a usage error names the value otherwise."""
    try:
        return ipaddress.IPv4Network(cidr, strict=False)
    except ValueError as exc:
        raise PlanError(f"--host-subnet {cidr!r} is not an IPv4 network in CIDR form, e.g. 10.1.2.0/24 ({exc})") \
            from None


def address_in_subnet(cidr: str, addresses: dict[str, str] | None = None) -> tuple[str, str]:
    """(address, interface) of the local interface whose address is in ``cidr``."""
    network = parse_subnet(cidr)
    addresses = local_addresses() if addresses is None else addresses
    for address, interface in sorted(addresses.items()):
        if ipaddress.ip_address(address) in network:
            return address, interface
    shown = ", ".join(f"{a} ({i})" for a, i in sorted(addresses.items())) or "none"
    raise PlanError(f"--host-subnet {cidr}: no local interface has an address in it; local addresses: {shown}")


def remote_hosts(hosts: list[str], resolve: bool = True) -> list[str]:
    """The hosts that are not this machine, in order.

    Names are resolved (when ``resolve``) only until the first remote host, whose route gives the
    callback address; later hosts are judged by name, so a list of thousands of hosts costs one
    look-up, not thousands, before mpiexec starts."""
    addresses = local_addresses() if resolve else {}
    remote: list[str] = []
    for host in hosts:
        if not (is_local(host, addresses) if resolve and not remote else is_local_name(host)):
            remote.append(host)
    return remote


def host_address(host: str, subnet: str | None) -> str:
    """An address of the remote ``host`` that every host reaches (torch's MASTER_ADDR when instance
    0 runs there): the one its name resolves to here, in ``subnet`` when given and one is; its
    name when it does not resolve (ssh or the launcher agent then names the problem)."""
    resolved = _resolve(host)
    if subnet:
        network = parse_subnet(subnet)
        inside = [a for a in resolved if ipaddress.ip_address(a) in network]
        resolved = inside or resolved
    return resolved[0] if resolved else host


def in_subnet(address: str, subnet: str) -> bool:
    """Whether ``address`` (an IPv4 address, else a name: not) is in ``subnet``."""
    try:
        return ipaddress.ip_address(address) in parse_subnet(subnet)
    except ValueError:
        return False


def callback_address(remote: list[str], subnet: str | None) -> str | None:
    """The address the ``remote`` hosts reach poprun on; None when there are none (loopback)."""
    if subnet:
        return address_in_subnet(subnet)[0]
    if not remote:
        return None
    address = address_towards(remote[0])
    if address is None:
        # Unknown or unreachable: mpiexec's launcher (ssh, an agent) names the host when it fails; if
        # instances do start, they can only call back on a routable address, so give one.
        address = next((a for a in local_addresses() if not ipaddress.ip_address(a).is_loopback), "127.0.0.1")
    return address
