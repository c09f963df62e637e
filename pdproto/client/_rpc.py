"""The client's settings and retries: the policy and the one retry loop (README.md here)."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType

import grpc

from pdproto import errors as E
from pdproto.errors import PdprotoError, Reason
from pdproto.rpc import error_from_rpc
from pdproto.v1 import handshake_service_pb2_grpc as hs_grpc

from ._auth import Metadata, Proof

CredentialReader = Callable[[int], bytes]
"""Reads the first n bytes of the decode's ``credential_buffer`` (``pdproto.transfer.CredentialSlot.read``)."""


@dataclass(frozen=True)
class RetryConfig:
    """Backoff for retryable errors (UNAVAILABLE); others are never retried."""

    attempts: int | None = None
    """Total tries including the first; None keeps retrying until the call's deadline."""
    initial_backoff: float = 0.05
    """Seconds before the second try."""
    max_backoff: float = 1.0
    """Upper bound of one sleep."""
    multiplier: float = 2.0
    """Growth of the sleep per try."""
    jitter: float = 0.2
    """Each sleep is scaled by a random factor within 1 ± ``jitter``, so that clients broken by
    one event do not all come back at the same instants, nor retry in step with a periodic fault."""

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise E.ConfigError(f"RetryConfig.attempts is {self.attempts}: at least 1 (the first try), "
                                "or None to retry until the deadline")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise E.ConfigError(f"RetryConfig backoffs {self.initial_backoff} and {self.max_backoff} s: "
                                "need 0 <= initial_backoff <= max_backoff")
        if self.multiplier < 1:
            raise E.ConfigError(f"RetryConfig.multiplier is {self.multiplier}: at least 1")
        if not 0 <= self.jitter < 1:
            raise E.ConfigError(f"RetryConfig.jitter is {self.jitter}: within [0, 1)")

    def backoffs(self) -> Iterator[float]:
        """Sleeps between the tries of one call (or of one session's resumes)."""
        delay = self.initial_backoff
        for _ in itertools.count() if self.attempts is None else range(self.attempts - 1):
            yield delay * random.uniform(1 - self.jitter, 1 + self.jitter)
            delay = min(delay * self.multiplier, self.max_backoff)


def retry_hint(error: PdprotoError) -> float | None:
    """Seconds a refusal says to wait before asking again (``retryAfterMs``: a peer's snapshot allowance,
    the queue of large registrations); None when it says nothing."""
    hint = error.metadata.get("retryAfterMs") if isinstance(error, E.ResourceLimitError) else None
    try:
        return None if hint is None else max(0.0, int(hint) / 1000)
    except ValueError:
        return None


def next_try(error: PdprotoError, backoffs: Iterator[float]) -> float | None:
    """Seconds to wait before trying again after ``error``, or None to give up: a retryable error takes
    the next backoff, a refusal that says when it frees (``retry_hint``) at least that long."""
    hint = retry_hint(error)
    if not error.retryable and hint is None:
        return None
    delay = next(backoffs, None)
    return None if delay is None else max(delay, hint or 0.0)


@dataclass(frozen=True)
class Settings:
    """What a client's calls and sessions share: the token's proof, the default deadline, the retry policy."""

    proof: Proof | None
    """The client's proof of its token to the server (None: no token, calls carry no credentials)."""
    timeout: float
    retry: RetryConfig

    async def metadata(self, stub: hs_grpc.HandshakeServiceAsyncStub, timeout: float) -> Metadata:
        """Call metadata: the proof of the token (``Authenticate`` on first use), when there is one."""
        return () if self.proof is None else await self.proof.metadata(stub, timeout)



class Tries:
    """The tries of one call within its deadline, the client's one retry loop::

        async for attempt in Tries(settings, timeout):
            with attempt:
                return await stub.Method(request, timeout=attempt.left(), metadata=await attempt.metadata(stub))

    A try that raises ``grpc.RpcError`` is read with ``error_from_rpc``; ``next_try`` says whether
    and when to try again, and the loop sleeps that long if it ends before the deadline, else raises
    the typed error (the ``RpcError`` as its ``__cause__``). A proof the server refused
    (UNAUTHENTICATED: it restarted, or the proof expired) is renewed and tried again at once, once.
    The loop ends after a try that did not fail: a stream that ended, or a unary try that returned
    from inside it.
    """

    def __init__(self, s: Settings, timeout: float | None) -> None:
        self._s = s
        self._end = time.monotonic() + (s.timeout if timeout is None else timeout)
        self._backoffs = s.retry.backoffs()
        self._failed: grpc.RpcError | None = None
        self._tried = False
        self._used: Metadata = ()
        self._renewed = False

    async def metadata(self, stub: hs_grpc.HandshakeServiceAsyncStub) -> Metadata:
        """This try's call metadata (``Settings.metadata``)."""
        self._used = await self._s.metadata(stub, self.left())
        return self._used

    def left(self) -> float:
        """Seconds to the deadline: this try's gRPC timeout."""
        return max(self._end - time.monotonic(), 0.001)

    def __aiter__(self) -> Tries:
        return self

    async def __anext__(self) -> Tries:
        failed, self._failed = self._failed, None
        if failed is None:
            if self._tried:
                raise StopAsyncIteration
            self._tried = True
            return self
        error = error_from_rpc(failed)
        proof = self._s.proof
        if error.reason is Reason.UNAUTHENTICATED and proof is not None and self._used and not self._renewed:
            self._renewed = True
            proof.renew(self._used)
            return self
        delay = next_try(error, self._backoffs)
        if delay is None or time.monotonic() + delay >= self._end:
            raise error from failed
        await asyncio.sleep(delay)
        return self

    def __enter__(self) -> Tries:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if isinstance(exc, grpc.RpcError):
            self._failed = exc  # read by the next __anext__: sleep and try again, or raise
            return True
        return False


def deadline_error(message: str, **metadata: object) -> E.DeadlineExceededError:
    """A deadline the client itself saw pass (as the server's DEADLINE_EXCEEDED reads)."""
    return E.DeadlineExceededError(message, reason=Reason.DEADLINE_EXCEEDED,
                                   metadata={"grpcCode": "DEADLINE_EXCEEDED", **metadata})


__all__ = [
    "RetryConfig",
    "Settings",
    "Tries",
    "deadline_error",
    "next_try",
    "retry_hint",
]
