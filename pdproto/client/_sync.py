"""The blocking client: ``AsyncHandshakeClient`` run on the process's shared loop thread."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

from pdproto.rpc import ChannelConfig
from pdproto.rpc.loop import LoopThread
from pdproto.v1 import transfer_pb2

from ._async import AsyncHandshakeClient
from ._rpc import RetryConfig

_T = TypeVar("_T")
_P = ParamSpec("_P")


async def _next(items: AsyncIterator[_T]) -> _T | None:
    return await anext(items, None)


def _blocking(method: Callable[Concatenate[AsyncHandshakeClient, _P], Coroutine[Any, Any, _T]],
              ) -> Callable[Concatenate[HandshakeClient, _P], _T]:
    """``method`` of the async client as a blocking one: run on the shared loop thread, waited for."""
    def run(self: HandshakeClient, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return self._loop.run(method(self._async, *args, **kwargs))
    functools.update_wrapper(run, method)  # its name and docstring
    run.__qualname__ = f"HandshakeClient.{method.__name__}"
    return run


class HandshakeClient:
    """Blocking client; reuse one per prefill rank (the channel is long-lived), from any threads.

    Each method runs the ``AsyncHandshakeClient`` method of the same name (and docstring) on one
    event loop thread that the process's blocking clients share (``LoopThread.shared``), and waits for it.
    """

    def __init__(self, target: str, *, token: str | None = None, root_cert: bytes | str | Path | None = None,
                 tls: bool = False, timeout: float = 5.0, retry: RetryConfig | None = None,
                 channel: ChannelConfig | None = None, server_name: str | None = None,
                 session: bool = True) -> None:
        self._async = AsyncHandshakeClient(target, token=token, root_cert=root_cert, tls=tls, timeout=timeout,
                                           retry=retry, channel=channel, server_name=server_name, session=session)
        self._loop = LoopThread.shared()

    def credential(self, peer_id: str) -> bytes:
        """The credential this client holds for ``peer_id`` (empty if none): hand it to another process."""
        return self._async.credential(peer_id)

    def adopt(self, peer_id: str, credential: bytes) -> None:
        """Act for a peer that another client registered, with the credential it was given."""
        self._async.adopt(peer_id, credential)

    get_server_info = _blocking(AsyncHandshakeClient.get_server_info)
    describe = _blocking(AsyncHandshakeClient.describe)
    evict = _blocking(AsyncHandshakeClient.evict)
    register = _blocking(AsyncHandshakeClient.register)
    submit_transfer = _blocking(AsyncHandshakeClient.submit_transfer)
    wait_for = _blocking(AsyncHandshakeClient.wait_for)
    abort = _blocking(AsyncHandshakeClient.abort)
    deregister = _blocking(AsyncHandshakeClient.deregister)
    close = _blocking(AsyncHandshakeClient.close)

    def watch_status(self, peer_id: str, rooms: Iterable[int] = (), *, timeout: float | None = None,
                     credential: bytes | None = None) -> Iterator[transfer_pb2.TransferStatus]:
        """Stream status changes (first the current state of matching requests) until the deadline.

        Raises ``DeadlineExceededError`` at the deadline (``UnavailableError`` when the session's stream
        is broken then); ends when the peer is removed. Closing the iterator early ends the watch.
        """
        statuses = self._async.watch_status(peer_id, rooms, timeout=timeout, credential=credential)
        try:
            while (status := self._loop.run(_next(statuses))) is not None:
                yield status
        finally:
            self._loop.run(statuses.aclose())

    def __enter__(self) -> HandshakeClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


__all__ = ["HandshakeClient"]
