"""The engine's token events to the routers: one frame a step for each router, whatever the
number of its streams (docs/processes.md "Router <-> engine").

A request still goes to the engine as one Serve streaming call (`TargetEngine.generate`): it
picks the engine replica, carries the prompt, and its cancellation (the client left) and its
failure (the replica died) reach the other side as before. But its only item is the address
of the replica's `EventServer`; the tokens come back over a TCP connection that each router
replica opens once to each engine replica it uses. The step loop hands a step's events to the
replica's event loop in one call, and each router gets them as one frame: a pickled list of
(request id, event dict). With Ray Serve streams, every request's every step was one Ray
object from the engine to the router (~0.5 ms of the engine's CPU a message and more of the
router's, measured at 8 streams; Ray's own advice for token streams is to batch them).

Frames: an 8-byte little-endian length, then the payload. A router opens its connection by
sending its id (a random hex string, never unpickled); the engine only writes pickles to the
routers, and a router reads only from the addresses the engine named through Serve. Events
for a router that has not connected yet wait for it (its first request's reply names the
address; a short request can end before the router has connected), and are dropped once the
router has had no request for `PENDING_TTL_S`. A connection that ends fails every request on
it with UNAVAILABLE, as a dead replica's calls do.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import struct
from collections import defaultdict

log = logging.getLogger(__name__)
HEADER = struct.Struct("<Q")
MAX_HELLO = 256  # bytes of a router id
PENDING_TTL_S = 60.0  # how long events wait for a router with no request left to connect
MAX_UNSENT = 64 << 20  # bytes a router may leave unread before its connection is closed
LOST = {"error": "UNAVAILABLE", "message": "the engine replica failed; retry the request",
        "finished": True}


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, limit: int | None = None) -> bytes:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if limit is not None and size > limit:
        raise ValueError(f"frame of {size} bytes, more than {limit}")
    return await reader.readexactly(size)


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class EventServer:
    """The engine replica's end: started on the event loop that runs `generate`; `send` is
    called on that loop."""

    def __init__(self, pending_ttl_s: float = PENDING_TTL_S, max_unsent: int = MAX_UNSENT):
        self.pending_ttl_s, self.max_unsent = pending_ttl_s, max_unsent
        self.address: tuple[str, int] | None = None
        self.writers: dict[str, asyncio.StreamWriter] = {}
        self.pending: dict[str, list[bytes]] = defaultdict(list)  # before the router connects
        self.active: dict[str, int] = defaultdict(int)  # requests in flight per router
        self.frames = self.events = self.bytes = 0
        self._started: asyncio.Future | None = None

    async def start(self, host: str) -> tuple[str, int]:
        """Listen on `host` (once; concurrent callers wait for the same start)."""
        if self._started is None:
            self._started = asyncio.ensure_future(asyncio.start_server(self._accept, host, 0))
        server = await asyncio.shield(self._started)
        if self.address is None:
            self.server = server
            self.address = (host, server.sockets[0].getsockname()[1])
        return self.address

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            router = (await asyncio.wait_for(read_frame(reader, MAX_HELLO), 10.0)).decode()
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError,
                UnicodeDecodeError, ConnectionError):
            writer.close()
            return
        _no_delay(writer)
        old = self.writers.get(router)
        if old is not None:
            old.close()
        self.writers[router] = writer
        for data in self.pending.pop(router, []):
            writer.write(data)
        try:
            await reader.read()  # nothing more comes: b"" when the router closes
        except ConnectionError:
            pass
        finally:
            if self.writers.get(router) is writer:
                del self.writers[router]
            writer.close()

    def opened(self, router: str) -> None:
        self.active[router] += 1

    def closed(self, router: str) -> None:
        """(On the event loop.) A request of `router` has ended: once it has none left, its
        waiting events are dropped after pending_ttl_s unless it has connected by then."""
        self.active[router] -= 1
        if self.active[router] <= 0:
            del self.active[router]
            if router in self.pending:
                asyncio.get_running_loop().call_later(self.pending_ttl_s, self._expire, router)

    def _expire(self, router: str) -> None:
        if router not in self.active:
            self.pending.pop(router, None)  # a router that never connected

    def send(self, router: str, items: list[tuple[str, dict]]) -> None:
        """One frame of (request id, event) pairs to `router` (kept until it connects)."""
        data = frame(pickle.dumps(items, protocol=5))
        self.frames += 1
        self.events += len(items)
        self.bytes += len(data)
        writer = self.writers.get(router)
        if writer is None or writer.is_closing():
            self.pending[router].append(data)  # (sent only for requests still open)
            return
        if writer.transport.get_write_buffer_size() > self.max_unsent:
            # a router that stopped reading: its requests fail (UNAVAILABLE) rather than this
            # replica's memory filling up; the engine cancels them as their calls end
            log.error("router %s left %d bytes of events unread: closing its connection",
                      router[:12], writer.transport.get_write_buffer_size())
            writer.transport.abort()
            return
        writer.write(data)

    def stats(self) -> dict:
        return {"event_frames": self.frames, "event_messages": self.events,
                "event_bytes": self.bytes, "event_routers": len(self.writers)}


class _Connection:
    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.requests: set[str] = set()
        self.closed = False
        self.task: asyncio.Future | None = None


class EventClient:
    """The router replica's end: a queue per request, a connection per engine replica (opened
    on first use, by the router's event loop)."""

    def __init__(self, router_id: str):
        self.router_id = router_id
        self.queues: dict[str, asyncio.Queue] = {}
        self.conns: dict[tuple[str, int], _Connection] = {}
        self._connecting: dict[tuple[str, int], asyncio.Future] = {}

    def open(self, request: str) -> asyncio.Queue:
        """The request's queue: open it before the engine can send (before the call)."""
        box = self.queues[request] = asyncio.Queue()
        return box

    def close(self, request: str) -> None:
        self.queues.pop(request, None)
        for conn in self.conns.values():
            conn.requests.discard(request)

    async def attach(self, request: str, address) -> None:
        """The engine replica at `address` (its `generate`'s one item) serves `request`:
        connect to it if this router has not yet; the request fails if the connection does."""
        address = (str(address[0]), int(address[1]))
        conn = self.conns.get(address)
        if conn is None or conn.closed:
            fut = self._connecting.get(address)
            if fut is None:
                fut = self._connecting[address] = asyncio.ensure_future(self._connect(address))
                fut.add_done_callback(lambda _f, a=address: self._connecting.pop(a, None))
            try:
                conn = await asyncio.shield(fut)
            except OSError as e:
                log.warning("cannot reach the engine replica's events at %s: %s", address, e)
                self._fail(request)
                return
        conn.requests.add(request)
        if conn.closed:
            self._fail(request)

    async def _connect(self, address) -> _Connection:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), 10.0)
        _no_delay(writer)
        writer.write(frame(self.router_id.encode()))
        conn = self.conns[address] = _Connection(reader, writer)
        conn.task = asyncio.ensure_future(self._read(address, conn))
        return conn

    async def _read(self, address, conn: _Connection) -> None:
        try:
            while True:
                items = pickle.loads(await read_frame(conn.reader))
                for request, event in items:
                    box = self.queues.get(request)
                    if box is not None:
                        box.put_nowait(event)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the replica went away (or closed: it stopped)
        except Exception:
            log.exception("bad events frame from the engine replica at %s", address)
        finally:
            conn.closed = True
            conn.writer.close()
            if self.conns.get(address) is conn:
                del self.conns[address]
            for request in list(conn.requests):
                self._fail(request)

    def _fail(self, request: str) -> None:
        box = self.queues.get(request)
        if box is not None:
            box.put_nowait(dict(LOST))


def merge(a: dict, b: dict) -> dict:
    """Two consecutive events of one request as one: b's tokens after a's, b's totals."""
    if "error" in b:
        return b
    logprobs = None if b.get("logprobs") is None else (a.get("logprobs") or []) + b["logprobs"]
    return {**b, "token_ids": a["token_ids"] + b["token_ids"], "logprobs": logprobs,
            "time": a["time"]}
