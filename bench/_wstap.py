"""A TCP relay between a browser and the Streamlit server that notes when each websocket frame passed it
(bench/bench_class.py's calibration): the browser loads the app from the relay's port, the relay reads
each side eagerly and forwards at once, so the time a server frame reaches it is the time the server
sent it, whatever the browser then does with it (Chromium's network stack hands a frame on only as its
page takes them: it can log a frame tens of ms after the server sent it).

Frames of the /_stcore/stream connections only (after the HTTP upgrade); uncompressed frames only
(this server declines permessage-deflate; a compressed frame is refused with ProtocolError).
"""
from __future__ import annotations

import asyncio
import re
import time

from bench._stclient import ProtocolError

STREAM = b"GET /_stcore/stream"
REQUEST = re.compile(rb"(?:GET|POST|PUT|HEAD|DELETE|OPTIONS) /\S*")


class FrameReader:
    """Websocket frames from a byte stream fed in chunks: `feed(data)` -> [(opcode, payload)] of the
    messages it completed (continuation frames joined; client frames unmasked)."""

    def __init__(self):
        self.buffer = b""
        self.parts: list[bytes] = []
        self.opcode = 0

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buffer += data
        done = []
        while True:
            frame = self._frame()
            if frame is None:
                return done
            fin, opcode, payload = frame
            if opcode:                                   # 0: a continuation of the message begun before
                self.opcode, self.parts = opcode, []
            self.parts.append(payload)
            if fin:
                done.append((self.opcode, b"".join(self.parts)))

    def _frame(self):
        b = self.buffer
        if len(b) < 2:
            return None
        if b[0] & 0x70:
            raise ProtocolError("a compressed (RSV1) websocket frame: the relay reads uncompressed frames only")
        size, at = b[1] & 0x7F, 2
        if size == 126:
            if len(b) < 4:
                return None
            size, at = int.from_bytes(b[2:4], "big"), 4
        elif size == 127:
            if len(b) < 10:
                return None
            size, at = int.from_bytes(b[2:10], "big"), 10
        masked = b[1] & 0x80
        key, at = (b[at:at + 4], at + 4) if masked else (b"", at)
        if len(b) < at + size:
            return None
        payload = b[at:at + size]
        if masked:
            payload = bytes(x ^ key[i % 4] for i, x in enumerate(payload))
        self.buffer = b[at + size:]
        return bool(b[0] & 0x80), b[0] & 0x0F, payload


class Tap:
    """`await start()` -> the relay's port; `frames`: (seconds on time.perf_counter, 'up' (browser ->
    server) or 'down', binary payload) of every websocket message, in the order they passed."""

    def __init__(self, server_port: int):
        self.server_port = server_port
        self.frames: list[tuple[float, str, bytes]] = []
        self.requests: list[tuple[float, str]] = []     # (seconds, "GET /path") of the other connections
        self._server = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _relay(self, browser_r, browser_w) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.server_port)
        first = await browser_r.read(65536)
        stream = first.startswith(STREAM)
        server_w.write(first)
        if not stream:
            self._requests(first, time.perf_counter())
        try:
            await asyncio.gather(self._pump(browser_r, server_w, "up", stream, first),
                                 self._pump(server_r, browser_w, "down", stream, b""))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (browser_w, server_w):
                w.close()

    async def _pump(self, reader, writer, side: str, stream: bool, seen: bytes) -> None:
        """Forward reader -> writer; on a stream connection, note each websocket message after the
        HTTP upgrade (the headers end at the first blank line of each side)."""
        frames, head = FrameReader(), seen
        upgraded = False
        if stream and b"\r\n\r\n" in head:
            upgraded, rest = True, head.split(b"\r\n\r\n", 1)[1]
            self._note(frames, rest, time.perf_counter(), side)
        while True:
            data = await reader.read(65536)
            now = time.perf_counter()
            if not data:
                writer.close()
                return
            writer.write(data)
            if not stream:
                if side == "up":
                    self._requests(data, now)
                continue
            if not upgraded:
                head += data
                if b"\r\n\r\n" not in head:
                    continue
                upgraded, data = True, head.split(b"\r\n\r\n", 1)[1]
            self._note(frames, data, now, side)

    def _requests(self, data: bytes, now: float) -> None:
        """Note the request lines in a chunk of a plain HTTP connection (keep-alive: several per connection)."""
        self.requests += [(now, m.group(0).decode(errors="replace")) for m in REQUEST.finditer(data)]

    def _note(self, frames: FrameReader, data: bytes, now: float, side: str) -> None:
        for opcode, payload in frames.feed(data):
            if opcode == 2:                                 # binary: a ForwardMsg or a BackMsg
                self.frames.append((now, side, payload))
