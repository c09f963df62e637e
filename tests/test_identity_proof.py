"""Identity squatting: a decode that binds its credential to its engine cannot be kept out or replaced.

A real ``pdproto serve`` (Mooncake and NIXL) and real decode ranks: the ``identity squat`` row of
``make reliability`` (``tests/reliability/hostile.py``), one round. The victim's registration
names a ``credential_buffer``; part of its credential arrives through the transfer engine. A
token holder copies the victim's registration (engine identity, buffers) as an attacker who
guessed them would:

* with the buffer, it is answered with half a credential: the rest went into the victim's
  memory, so the squatter can neither open a stream nor submit, and the victim registers over it;
* without the buffer (an unbound registration), it holds a status stream, and still the victim,
  which proves its engine, takes the identity over; the squatter's credential dies with it;
* once the victim is registered and reading its stream, every later claim is refused
  ``IDENTITY_IN_USE``, bound or not, and the victim's transfers land byte-exact.
"""

from __future__ import annotations

import pytest

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto_demo.decode import DecodeRank

from ._server_harness import SERVE_ARGS, SPEC, running_server
from .reliability.hostile import identity_squat

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

TOKEN = "shared-deployment-token"


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_squatters_never_hold_the_identity_of_a_decode_that_binds_its_credential(backend: str) -> None:
    out = identity_squat(backend, rounds=1)
    assert out.passed and not out.problems, out
    # Refused: the bound squatter's stream and submit, the displaced one's submit, both claims on the
    # live victim; the live unbound squatter was displaced; the notify-endpoint squatter kept no one out.
    assert (out.faults, out.failed_expected) == (7, 7), out
    assert "live unbound squatter: displaced by the decode that proved its engine" in out.notes
    assert "notify-endpoint squatter: the victim registered beside it" in out.notes
    assert out.ok == 3 and out.bytes_verified > 0 and (out.lost, out.corrupted) == (0, 0), out


def test_a_bound_registration_refuses_a_credential_buffer_of_another_memory_kind_or_too_small() -> None:
    victim = DecodeRank.for_spec(SPEC, pages=8, backend="mooncake")
    try:
        with running_server(*SERVE_ARGS, "--backend", "mooncake", token=TOKEN) as srv, \
                HandshakeClient(srv.target, token=TOKEN, timeout=10) as client:
            reg = victim.registration(bound=True)
            reg.credential_buffer.length = 8
            with pytest.raises(E.InvalidFieldError) as info:
                client.register(reg, read_credential=victim.credential.read)
            assert info.value.field == "registration.credential_buffer.length"
            reg = victim.registration(bound=True)
            reg.credential_buffer.ptr = 64  # no memory of the victim's engine lies there
            with pytest.raises(E.InvalidFieldError) as info:
                client.register(reg, read_credential=victim.credential.read)
            assert info.value.field == "registration.credential_buffer"
            with pytest.raises(E.ConfigError):
                client.register(victim.registration(bound=True))  # nothing to read the engine's half with
    finally:
        victim.close()
