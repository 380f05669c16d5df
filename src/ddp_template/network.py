"""Which network interface a multi-node gloo job's collectives use.

gloo binds each rank to the address its host's name resolves to. On Debian and Ubuntu a host's
own name is ``127.0.1.1`` in ``/etc/hosts``, so a rank binds the loopback, publishes that
address, and the other hosts' ranks fail with "Connection refused, remote=[127.0.1.1]". On a
host with several interfaces (a management network, InfiniBand, a container bridge) the name may
resolve to one the other hosts cannot reach. The template therefore sets ``GLOO_SOCKET_IFNAME``
(unless the user did) to the interface the kernel routes the rendezvous address through; on the
rendezvous host itself, where that route is the loopback, to the interface it routes a peer
host's address through: every rank publishes its own route's address in the rendezvous store.
Where every rank's route is the loopback (several nodes on one machine) gloo's default serves.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import psutil
import torch.distributed as dist

log = logging.getLogger("ddp_template")

VARIABLE = "GLOO_SOCKET_IFNAME"
ROUTE_KEY = "network/route"  # + /<rank>: the address each rank routes the rendezvous from


@dataclass(frozen=True)
class Interface:
    name: str
    address: str
    why: str


def route_source(address: str) -> str:
    """The local address the kernel sends packets to ``address`` from (no packet is sent)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # UDP connect only picks the route
        return str(probe.getsockname()[0])


def interface_of(address: str) -> str | None:
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def _resolve(host: str) -> str:
    return str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def choose(
    master_addr: str, rank: int, world: int, store: dist.Store | None, timeout: timedelta
) -> Interface | None:
    """The interface this rank's collectives should use to reach the other hosts; None where
    every rank routes the rendezvous through the loopback (all on this machine), or where it
    cannot be told (no store to learn the other ranks' routes from)."""
    source = route_source(_resolve(master_addr))
    if store is not None:
        store.set(f"{ROUTE_KEY}/{rank}", source)
    if not _loopback(source):
        name = interface_of(source)
        why = f"routes the rendezvous host {master_addr} from {source}"
        return Interface(name, source, why) if name else None
    if store is None:
        log.warning(
            "could not tell which interface reaches the other hosts; gloo binds the address "
            "this host's name resolves to. If ranks fail to connect, export %s=<interface>.",
            VARIABLE,
        )
        return None
    store.set_timeout(timeout)
    routes = store.multi_get([f"{ROUTE_KEY}/{r}" for r in range(world)])
    peer = next((a.decode() for a in routes if not _loopback(a.decode())), None)
    if peer is None:
        return None  # the rendezvous is this machine's loopback for every rank: one machine
    source = route_source(peer)
    name = interface_of(source)
    why = f"on the rendezvous host, routes a peer host's {peer} from {source}"
    return Interface(name, source, why) if name else None


def bind_gloo(
    master_addr: str, rank: int, world: int, store: dist.Store | None, timeout: timedelta
) -> Interface | None:
    """Set ``GLOO_SOCKET_IFNAME`` for this multi-node rank unless the user set it."""
    if os.environ.get(VARIABLE):
        name = os.environ[VARIABLE]
        addrs = psutil.net_if_addrs().get(name, [])
        address = next((a.address for a in addrs if a.family == socket.AF_INET), "")
        return Interface(name, address, f"{VARIABLE} set by the user")
    chosen = choose(master_addr, rank, world, store, timeout)
    if chosen is not None:
        os.environ[VARIABLE] = chosen.name
    return chosen
