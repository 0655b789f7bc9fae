"""This machine's network addresses, as rvodrun needs them: a NIC's IPv4 address, and the local address
that routes to a peer.

A one-host job keeps everything on loopback. A job with remote hosts serves its rendezvous store on the
address of the first --network-interface given, or else on the local address the kernel would use to reach
the first remote host (the same route the ranks' replies take). Problems are `ValueError`s for the user.
"""

from __future__ import annotations

import fcntl
import socket
import struct

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915
_IFNAMSIZ = 16


def interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def interface_address(name: str) -> str:
    """The IPv4 address of NIC `name`; ValueError naming the NIC when it does not exist or has none."""
    if name not in interface_names():
        raise ValueError(f"network interface {name!r} does not exist on this machine "
                         f"(it has {', '.join(interface_names())})")
    if len(name.encode()) >= _IFNAMSIZ:
        raise ValueError(f"network interface name {name!r} is too long")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError:
            raise ValueError(f"network interface {name!r} has no IPv4 address") from None
    return socket.inet_ntoa(reply[20:24])


def resolve(name: str) -> str:
    """The IPv4 address of host `name`; ValueError naming the host when it does not resolve."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve host {name!r}: {error.strerror}") from None
    return str(infos[0][4][0])


def route_source(peer: str) -> str:
    """The local address the kernel picks to reach IPv4 address `peer` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, 9))
        except OSError as error:
            raise ValueError(f"no route from this machine to {peer}: {error.strerror}") from None
        return str(probe.getsockname()[0])
