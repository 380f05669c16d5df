"""Which interface a multi-node gloo rank binds (``network.py``), against this machine's own
routes; across real hosts: tests/test_hosts.py."""

from __future__ import annotations

import socket
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from ddp_template import network

TIMEOUT = timedelta(seconds=5)


def _outside_address() -> tuple[str, str] | None:
    """An interface of this machine with a non-loopback IPv4 address, and that address."""
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return name, a.address
    return None


def test_a_rank_on_another_host_takes_the_route_to_the_rendezvous_and_publishes_it() -> None:
    found = _outside_address()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    name, address = found
    store = dist.HashStore()
    chosen = network.choose(address, 3, 4, store, TIMEOUT)
    assert chosen is not None and (chosen.name, chosen.address) == (name, address)
    assert store.get(f"{network.ROUTE_KEY}/3").decode() == address


def test_on_the_rendezvous_host_the_route_to_a_published_peer_is_taken() -> None:
    """The rendezvous name resolves to a loopback address here (Debian's 127.0.1.1): the route
    to a rank's published address that is not a loopback one decides, not the name."""
    found = _outside_address()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    name, address = found
    store = dist.HashStore()
    store.set(f"{network.ROUTE_KEY}/1", "127.0.0.1")  # another rank of this host
    store.set(f"{network.ROUTE_KEY}/2", address)  # a rank of another host
    chosen = network.choose("127.0.1.1", 0, 3, store, TIMEOUT)
    assert chosen is not None and chosen.name == name
    assert network.choose("127.0.1.1", 0, 3, None, TIMEOUT) is None  # no store: no routes


def test_when_every_rank_routes_through_the_loopback_gloo_keeps_its_default() -> None:
    """Several nodes on one machine (two torchrun agents on localhost): nothing to choose."""
    store = dist.HashStore()
    store.set(f"{network.ROUTE_KEY}/1", "127.0.0.1")
    assert network.choose("127.0.0.1", 0, 2, store, TIMEOUT) is None


def test_the_users_choice_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(network.VARIABLE, "lo")
    chosen = network.bind_gloo("127.0.0.1", 0, 2, None, TIMEOUT)
    assert chosen is not None and (chosen.name, chosen.address) == ("lo", "127.0.0.1")
    assert "set by the user" in chosen.why
