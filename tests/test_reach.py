"""The pure multi-host rule (``pdproto.negotiation.reach``) and how an executor picks the address it advertises."""

from __future__ import annotations

import pytest

from pdproto.negotiation import reach
from pdproto.transfer import address
from pdproto.v1 import registration_pb2


@pytest.mark.parametrize(("host", "loop"), [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("LOCALHOST", True),
                                            ("10.0.0.2", False), ("fd00::2", False), ("prefill-0", False),
                                            ("0.0.0.0", False), ("", False)])
def test_loopback_addresses(host: str, loop: bool) -> None:
    assert reach.is_loopback(host) is loop


@pytest.mark.parametrize(("peer", "host"), [("ipv4:10.0.0.2:5000", "10.0.0.2"), ("ipv6:[fd00::2]:5000", "fd00::2"),
                                            ("ipv6:%5B::1%5D:443", "::1"), ("unix:/tmp/s", None), ("", None),
                                            ("ipv4:127.0.0.1:1", "127.0.0.1")])
def test_grpc_peer_hosts(peer: str, host: str | None) -> None:
    assert reach.grpc_peer_host(peer) == host


def _mooncake(session: str) -> registration_pb2.KvRegistration:
    reg = registration_pb2.KvRegistration()
    reg.mooncake.session_id = session
    return reg


def test_a_loopback_engine_registered_from_another_host_is_unreachable() -> None:
    found = reach.unreachable(_mooncake("127.0.0.1:15000"), "ipv4:10.0.0.2:41000")
    assert [f for f, _ in found] == ["registration.mooncake.session_id"]
    assert "PDPROTO_ADVERTISE_HOST" in found[0][1] and "10.0.0.2" in found[0][1]
    assert reach.unreachable(_mooncake("[::1]:15000"), "ipv4:10.0.0.2:41000")


@pytest.mark.parametrize(("session", "peer"), [("127.0.0.1:15000", "ipv4:127.0.0.1:41000"),  # same host
                                               ("10.0.0.2:15000", "ipv4:10.0.0.2:41000"),  # routable
                                               ("decode-0:15000", "ipv4:10.0.0.2:41000"),  # a name: not ours to resolve
                                               ("127.0.0.1:15000", "unix:/run/pdproto.sock"),
                                               ("127.0.0.1:15000", "")])
def test_everything_else_is_left_to_the_engine(session: str, peer: str) -> None:
    assert reach.unreachable(_mooncake(session), peer) == []


def test_endpoints_without_a_host_are_not_judged() -> None:
    reg = registration_pb2.KvRegistration()
    reg.nixl.agent_name = "a"
    assert reach.engine_host(reg) is None and reach.unreachable(reg, "ipv4:10.0.0.2:1") == []
    assert reach.engine_host(registration_pb2.KvRegistration()) is None


def test_the_advertised_address_is_the_configured_one_else_routable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(reach.ADVERTISE_ENV, "10.9.8.7")
    assert address.advertise_host() == "10.9.8.7"
    monkeypatch.delenv(reach.ADVERTISE_ENV)
    routable = [a for _, a in address.interface_addresses() if not reach.is_loopback(a)]
    chosen = address.advertise_host()
    assert chosen in routable if routable else chosen == "127.0.0.1"
    assert address.advertise_host(toward="127.0.0.1") == "127.0.0.1"  # a prefill on this host
