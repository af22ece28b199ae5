"""Which network interface gloo uses. Gloo (torch's CPU backend, which GPU jobs use too for
their CPU collectives) binds the address the host's own name resolves to, and Debian and Ubuntu
map that name to 127.0.1.1 in /etc/hosts: ranks on other hosts would then be told to dial their
own loopback, and every connection across hosts times out. `point_gloo_at(address)` names the
interface that reaches `address` (a peer, the rendezvous host, a lighthouse) instead, unless
`GLOO_SOCKET_IFNAME` already names one. Standard library only; Linux (elsewhere it does
nothing)."""

from __future__ import annotations

import os
import socket
import struct

GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_towards(address: str) -> str | None:
    """The interface this host reaches `address` through: the one holding the source address
    the kernel picks for it (for one of this host's own addresses, the one holding it). None
    where that cannot be told (IPv6, no route, not Linux)."""
    try:
        import fcntl
    except ImportError:  # not a Unix
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(address), 9))  # UDP: nothing is sent
            local = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:
                    reply = fcntl.ioctl(
                        s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                    )
                except OSError:  # no IPv4 address on it
                    continue
                if socket.inet_ntoa(reply[20:24]) == local:
                    return name
    except OSError:
        return None
    return None


def point_gloo_at(address: str, env: dict[str, str] | None = None) -> str | None:
    """Set GLOO_SOCKET_IFNAME in `env` (default: this process's environment) to the interface
    that reaches `address`, unless it is set already or that interface is the loopback one (a
    job on one host). Returns the interface it set, or None."""
    env = os.environ if env is None else env
    if env.get(GLOO_INTERFACE):
        return None
    interface = interface_towards(address)
    if interface is None or interface == "lo":
        return None
    env[GLOO_INTERFACE] = interface
    return interface
