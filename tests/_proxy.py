"""A TCP relay on loopback whose connections a test can cut: a network break between a client and a server.

``CuttableProxy(upstream_port)`` listens on its own port (``proxy.target``) and relays
bytes both ways; ``cut()`` drops every open connection at once (both sockets reset), as
a failed link would. ``blackhole()`` first discards what the server sends while the
client's bytes still arrive: what the server wrote then is lost, as on a link that dies
without either end noticing. New connections are accepted again right away, so a client
that reconnects reaches the same server.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time


class CuttableProxy:
    """A relay to 127.0.0.1:``upstream`` running on its own event loop thread."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.cuts = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._dropping = False
        self.dropped = 0
        """Bytes from the server discarded by ``blackhole``."""
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self.port = 0
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("proxy did not start")

    @property
    def target(self) -> str:
        """gRPC target of the proxy."""
        return f"127.0.0.1:{self.port}"

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer, downstream=True),
                                 return_exceptions=True)
        except asyncio.CancelledError:
            # ``close`` cancels the relays. asyncio's stream callback asks a connection handler's
            # task for its exception, which a cancelled task raises (a logged traceback per link).
            pass
        self._writers -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    downstream: bool = False) -> None:
        try:
            while data := await reader.read(65536):
                if downstream and self._dropping:
                    self.dropped += len(data)
                    continue
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def _cut_now(self) -> None:
        self.cuts += 1
        self._dropping = False
        for writer in list(self._writers):
            sock = writer.get_extra_info("socket")
            if sock is not None and sock.fileno() >= 0:  # the other side may have closed it already
                # Reset, not a polite close: the peer sees a broken connection.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            writer.transport.abort()
        self._writers.clear()

    def blackhole(self) -> None:
        """From now until the next ``cut``, discard every byte the server sends."""
        self._loop.call_soon_threadsafe(setattr, self, "_dropping", True)

    def cut(self) -> None:
        """Drop every open connection now."""
        done = threading.Event()

        def run() -> None:
            self._cut_now()
            done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(5)

    def cut_repeatedly(self, stop: threading.Event, every: float = 0.1) -> threading.Thread:
        """A started thread that, until ``stop`` is set, waits ``every`` s, loses what the server
        sends for ``every`` s (``blackhole``), then cuts the link: breaks that lose bytes."""

        def run() -> None:
            while not stop.wait(every):
                self.blackhole()
                time.sleep(every)
                self.cut()

        thread = threading.Thread(target=run, name="proxy-cuts", daemon=True)
        thread.start()
        return thread

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        self._cut_now()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop relaying and listening."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
