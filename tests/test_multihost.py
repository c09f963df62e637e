"""Multi-host: executors advertise a routable address, and a loopback engine from another host is refused.

* Over this host's own non-loopback address (no namespaces needed): a Register whose
  Mooncake session is on 127.0.0.1, arriving from a non-loopback peer, is refused at
  Register with a reason that names ``PDPROTO_ADVERTISE_HOST``.
* Across two network namespaces joined by a veth pair (``tests/_netns.py``; root and
  ``ip netns``, skipped with the reason otherwise): ``pdproto serve`` in one, decodes in
  the other, on Mooncake and on NIXL. A decode with default settings moves its requests
  byte-exact; one that advertises 127.0.0.1 is refused at Register.

Run only these: ``.venv/bin/python -m pytest tests/test_multihost.py -q`` (as root).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdproto.client import HandshakeClient
from pdproto.errors import InvalidFieldError, PdprotoError
from pdproto.negotiation.reach import is_loopback
from pdproto.transfer.address import interface_addresses
from pdproto_demo.decode import DecodeRank

from . import _netns
from ._server_harness import SERVE_ARGS, SPEC, running_server

pytestmark = [pytest.mark.process, pytest.mark.timeout(400)]

NETNS, WHY_NOT = _netns.available()
ROUTABLE = [a for _, a in interface_addresses() if not is_loopback(a)]


@pytest.mark.skipif(not ROUTABLE, reason="this host has no non-loopback IPv4 address to call itself on")
def test_a_loopback_engine_registered_from_another_address_is_refused_with_what_to_set() -> None:
    rank = DecodeRank.for_spec(SPEC, pages=16)
    reg = rank.registration()
    reg.mooncake.session_id = "127.0.0.1:15999"  # what a Mooncake engine used to advertise by default
    try:
        with running_server(*SERVE_ARGS, "--listen", "0.0.0.0:0", token="multihost-token") as srv:
            with HandshakeClient(f"{ROUTABLE[0]}:{srv.port}", token=srv.token, timeout=20) as client:
                with pytest.raises(InvalidFieldError) as info:
                    client.register(reg)
            assert info.value.field == "registration.mooncake.session_id"
            assert "PDPROTO_ADVERTISE_HOST" in info.value.message and "loopback" in info.value.message
            # The same registration over loopback is not judged by this rule (same host).
            with HandshakeClient(f"127.0.0.1:{srv.port}", token=srv.token, timeout=20) as client:
                with pytest.raises(PdprotoError) as other:
                    client.register(reg)
            assert "PDPROTO_ADVERTISE_HOST" not in other.value.message
    finally:
        rank.close()


@pytest.mark.skipif(not NETNS, reason=f"no network namespaces here: {WHY_NOT}")
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_prefill_and_decodes_in_two_network_namespaces(backend: str) -> None:
    r = _netns.multihost(backend, requests=3)
    assert r["serve_first_line"].startswith('{"event": "listening"'), r
    default = r["default"]
    assert default.get("ok") == 3 and default["checked"] > 0, r
    if backend == "mooncake":
        assert not is_loopback(default["session_id"].rpartition(":")[0]), default
    refused = r["loopback"]["refused"]
    assert refused["reason"] == "INVALID_FIELD", r["loopback"]
    assert "PDPROTO_ADVERTISE_HOST" in refused["message"], refused
    assert r["serve_alive"], r


def test_an_advertised_address_limits_this_nixl_agent_only_not_the_processes_started_after() -> None:
    # A NIXL executor kept to loopback once left UCX_NET_DEVICES=lo in os.environ, so a process
    # started afterwards (a decode in another namespace) could only offer loopback to its peer.
    probe = ("import os, json\n"
             "from pdproto.transfer import create_executor\n"
             "ex = create_executor('nixl', host='127.0.0.1')\n"
             "print(json.dumps({'left': os.environ.get('UCX_NET_DEVICES')}))\n"
             "ex.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == '{"left": null}', done.stdout
