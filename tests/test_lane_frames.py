"""The session lane's framing (``pdproto.client_lane.FrameReader``) against any cut of the byte stream.

The reader takes whatever a read returns and keeps the rest, so what a stream is cut into
must not matter: the frames come out whole, in order, and none twice; a length over the
limit is refused before its body arrives; a stream that ends mid-frame reads as the end.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproto.client_lane import HEADER, FrameReader
from pdproto.errors import MessageTooLargeError


def _stream(bodies: list[bytes]) -> bytes:
    return b"".join(HEADER.pack(len(b)) + b for b in bodies)


def _read_all(data: bytes, cuts: list[int], limit: int, *, eof: bool = True) -> list[bytes | None]:
    """Feed ``data`` in pieces at ``cuts`` while a FrameReader reads; every frame, then what the end reads as."""

    async def main() -> list[bytes | None]:
        reader = asyncio.StreamReader(limit=1 << 16)
        frames = FrameReader(reader)
        out: list[bytes | None] = []

        async def feed() -> None:
            start = 0
            for cut in [*sorted(set(cuts)), len(data)]:
                reader.feed_data(data[start:cut])
                start = cut
                await asyncio.sleep(0)  # let the reader take a partial piece
            if eof:
                reader.feed_eof()

        feeder = asyncio.get_running_loop().create_task(feed())
        while True:
            frame = await asyncio.wait_for(frames.next(limit), 5)
            out.append(frame)
            if frame is None:
                break
        await feeder
        return out

    return asyncio.run(main())


@given(st.lists(st.binary(max_size=300), max_size=12), st.data())
def test_frames_come_out_whole_and_in_order_whatever_the_cuts(bodies: list[bytes], data: st.DataObject) -> None:
    stream = _stream(bodies)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20))
    assert _read_all(stream, cuts, limit=300) == [*bodies, None]


@given(st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=6), st.data())
def test_a_stream_that_ends_mid_frame_reads_as_the_end(bodies: list[bytes], data: st.DataObject) -> None:
    stream = _stream(bodies)
    cut = data.draw(st.integers(1, len(stream) - 1))
    whole = [b for i, b in enumerate(bodies) if len(_stream(bodies[:i + 1])) <= cut]
    assert _read_all(stream[:cut], [], limit=64) == [*whole, None]


def test_a_length_over_the_limit_is_refused_before_its_body_arrives() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        frames = FrameReader(reader)
        reader.feed_data(HEADER.pack(1001))  # the header alone: nothing of the body was sent
        with pytest.raises(MessageTooLargeError) as refused:
            await asyncio.wait_for(frames.next(1000), 5)
        assert refused.value.metadata == {"bytes": "1001", "limit": "1000"}

    asyncio.run(main())


def test_a_wait_cancelled_mid_frame_loses_nothing() -> None:
    """An open deadline or a connect timeout cancels ``next`` while a frame is half read."""

    async def main() -> None:
        reader = asyncio.StreamReader()
        frames = FrameReader(reader)
        stream = _stream([b"first", b"second"])
        reader.feed_data(stream[:7])  # the first header and two bytes of its body
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(frames.next(100), 0.05)
        reader.feed_data(stream[7:])
        assert [await frames.next(100), await frames.next(100)] == [b"first", b"second"]

    asyncio.run(main())
