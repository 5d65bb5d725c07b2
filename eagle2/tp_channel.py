"""The step channel of tensor parallelism: the driver's per-step messages to its ranks.

See docs/tensor-parallel.md "Ranks on Ray". The driver (the engine replica) keeps one TCP
connection to each rank; a step is one message, serialized once and written to every rank
(a broadcast), and one reply, from rank 0 only. The ranks run a loop that reads messages until
the driver closes the channel (`RankChannel.receive` raises `ConnectionError`).

Why sockets and not a gloo broadcast or a shared-memory ring (what the production engines use:
SGLang's `broadcast_pyobj` over a gloo CPU group, vLLM's shared-memory `MessageQueue`, whose
readers on other nodes read through a ZMQ socket): a gloo op hands its work to the process
group's worker thread and the transport's I/O thread on each side, and a shared-memory reader
polls; with the ranks and the driver sharing a few cores (the CPU deployment), each handoff
and each poller waits for a core. Measured on 2 cores at load 8-14: a 4 KiB gloo broadcast
to two ranks plus a 64 B reply took 1.9-3.9 ms, the same over sockets 22-58 us
(`benchmarks/tp_step_channel.py --probe`). A socket read wakes the one thread
that blocks in it, and a rank that dies closes its socket at once, so the driver's `select`
sees the death (end of file) without a timeout; a rank that raises sends its error instead of
a result.

Frames: an 8-byte little-endian payload length, then a pickle (protocol 5) in which tensors
travel as their raw bytes, dtype and shape (`dumps` / `loads`; torch's own pickling of a
small tensor costs ~10x more). Pure Python and torch: this module knows nothing of Ray.
"""

from __future__ import annotations

import io
import pickle
import select
import socket
import struct
import time
from collections import Counter

import torch

HEADER = struct.Struct("<Q")  # payload bytes of a frame


def dumps(obj) -> bytes:
    """Pickle `obj` with every tensor as (raw bytes, dtype, shape), moved to the CPU."""
    buf = io.BytesIO()
    _TensorPickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def loads(data: bytes | bytearray | memoryview):
    return pickle.loads(data)


# dtypes numpy lacks travel as the same bits in an integer of their width
_AS_INT = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8,
           torch.float8_e5m2: torch.uint8}
_NAMES: dict[torch.dtype, str] = {}


def as_numpy(t: torch.Tensor):
    """A contiguous CPU tensor's memory as a numpy array (no copy): what sockets write from
    and read into. Dtypes numpy lacks give the same bits as an integer of their width."""
    return (t.view(_AS_INT[t.dtype]) if t.dtype in _AS_INT else t).numpy()


class _TensorPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        t = obj.detach()  # a view: copied below only when off the CPU or not contiguous
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        name = _NAMES.get(t.dtype) or _NAMES.setdefault(t.dtype,
                                                        str(t.dtype).removeprefix("torch."))
        array = as_numpy(t)
        # a writable buffer is written into the pickle as it is and read back as a bytearray
        return _tensor, (pickle.PickleBuffer(array), name, tuple(t.shape))


def _tensor(raw: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of its own (writable: the ranks write into positions and slots they get)."""
    dt = getattr(torch, dtype)
    if not raw:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(raw, dtype=dt).reshape(shape)


class RankLost(ConnectionError):
    """A rank's connection ended (its process died or closed it) or failed."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank}: {detail}")
        self.rank = rank


class RankError(RuntimeError):
    """A rank's step raised; `kind` is the exception's type name (e.g. OutOfMemoryError)."""

    def __init__(self, rank: int, kind: str, message: str):
        super().__init__(f"rank {rank}: {kind}: {message}")
        self.rank, self.kind = rank, kind


def free_port(host: str = "") -> int:
    """A port nothing listens on now (on `host`; "": every interface), for a server to bind."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _send_frame(sock: socket.socket, payload: bytes) -> int:
    """-> bytes written. A small frame goes as one write (one segment, one wake-up)."""
    if len(payload) < 65536:
        sock.sendall(HEADER.pack(len(payload)) + payload)
    else:  # no concatenated copy of a big one
        sock.sendall(HEADER.pack(len(payload)))
        sock.sendall(payload)
    return HEADER.size + len(payload)


def recv_exact(sock: socket.socket, size: int, wait=None) -> bytearray:
    """`size` bytes from `sock`; ConnectionError when the peer closes first. wait(): called
    until bytes are there, before reading them (it may raise instead: `SocketGroup.watch`)."""
    out = bytearray(size)
    recv_into_exact(sock, memoryview(out), wait)
    return out


def recv_into_exact(sock: socket.socket, view: memoryview, wait=None) -> None:
    """Fill `view` (bytes) from `sock`, as `recv_exact` (with `wait`: only when no bytes are
    there yet, so bytes already there cost one system call)."""
    got, size = 0, view.nbytes
    while got < size:
        rest = view[got:] if got else view
        if wait is None:
            n = sock.recv_into(rest, size - got)
        else:
            try:
                n = sock.recv_into(rest, size - got, socket.MSG_DONTWAIT)
            except BlockingIOError:
                wait()
                continue
        if n == 0:
            raise ConnectionError("connection closed")
        got += n


def _recv_frame(sock: socket.socket) -> bytearray:
    (size,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    return recv_exact(sock, size)


class DriverChannel:
    """The driver's end: a listening socket, then one connection per rank (rank order)."""

    def __init__(self, host: str, ranks: list[int]):
        """ranks: the ranks that connect (all of them, or all but rank 0 where the driver
        runs rank 0 itself)."""
        self.ranks = list(ranks)
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1])  # what the ranks connect to
        self._socks: dict[int, socket.socket] = {}
        # frames_out / bytes_out: frames written to ranks and their bytes (one frame a rank);
        # frames_in / bytes_in: frames read back
        self.counts: Counter = Counter()

    def accept(self, timeout_s: float, alive=lambda: None) -> None:
        """Wait for every rank to connect and name itself. alive(): called every second while
        waiting; it raises when a rank can no longer connect (e.g. its loop failed)."""
        socks: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout_s
        self._listener.settimeout(1.0)
        while len(socks) < len(self.ranks):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.ranks) - len(socks)} ranks did not connect "
                                   f"within {timeout_s} s")
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                alive()
                continue
            sock.settimeout(timeout_s)  # a frame that starts must end within the timeout
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            (rank,) = HEADER.unpack(recv_exact(sock, HEADER.size))
            socks[rank] = sock
        self._listener.close()
        self._socks = {r: socks[r] for r in self.ranks}
        self._rank_of = {sock.fileno(): rank for rank, sock in self._socks.items()}
        self._poller = select.poll()  # (select.select stops at descriptor 1024)
        for sock in self._socks.values():
            self._poller.register(sock, select.POLLIN)

    @property
    def sockets(self) -> list[socket.socket]:
        """The connections to the ranks (rank order)."""
        return list(self._socks.values())

    def broadcast(self, message) -> int:
        """Serialize `message` once and write it to every rank; -> bytes written."""
        payload = dumps(message)
        sent = 0
        for rank, sock in self._socks.items():
            try:
                sent = _send_frame(sock, payload)
            except OSError as e:
                raise RankLost(rank, f"send failed ({type(e).__name__}: {e})") from e
        self.counts["frames_out"] += len(self._socks)
        self.counts["bytes_out"] += sent * len(self._socks)
        return sent * len(self._socks)

    def receive(self, ranks: tuple[int, ...], timeout_s: float) -> list:
        """The replies of `ranks`, in that order. Any rank's connection is watched meanwhile:
        one that ends raises RankLost, an error report RankError, and nothing within
        timeout_s TimeoutError."""
        replies: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(ranks):
            left_ms = max(deadline - time.monotonic(), 0) * 1000
            ready = self._poller.poll(left_ms)
            if not ready:
                raise TimeoutError(f"no reply from the ranks within {timeout_s} s")
            for fd, _ in ready:
                rank = self._rank_of[fd]
                value = self._read(rank)
                assert rank in ranks and rank not in replies, f"unasked reply from rank {rank}"
                replies[rank] = value
        return [replies[r] for r in ranks]

    def poll(self, timeout_s: float = 0.0) -> None:
        """Raise RankLost / RankError if a rank's connection ended or reported an error while
        no step ran (a health check: no rank writes between steps otherwise), or ends or
        reports within timeout_s."""
        ready = self._poller.poll(timeout_s * 1000)
        if ready:
            rank = self._rank_of[ready[0][0]]
            self._read(rank)
            raise RankLost(rank, "a reply nobody asked for")

    def _read(self, rank: int):
        """Rank `rank`'s next reply; RankLost when its connection ended, RankError when it
        reports an error."""
        try:
            frame = _recv_frame(self._socks[rank])
        except (OSError, ConnectionError) as e:
            raise RankLost(rank, f"connection lost ({type(e).__name__}: {e})") from e
        self.counts["frames_in"] += 1
        self.counts["bytes_in"] += HEADER.size + len(frame)
        ok, value = loads(frame)
        if not ok:
            raise RankError(rank, *value)
        return value

    def close(self) -> None:
        """Close every connection: the ranks' loops end (their receive raises)."""
        for sock in self._socks.values():
            sock.close()
        self._socks = {}
        self._listener.close()


class RankChannel:
    """A rank's end: connects to the driver and names its rank."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float = 60.0):
        self.rank = rank
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.settimeout(None)  # idle between steps for as long as the driver is
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(HEADER.pack(rank))

    def receive(self):
        """The next message (blocks); ConnectionError when the driver closed the channel."""
        return loads(_recv_frame(self._sock))

    def reply(self, value) -> None:
        _send_frame(self._sock, dumps((True, value)))

    def report(self, error: BaseException) -> None:
        """Tell the driver this rank's step raised `error` (best effort: it may be gone)."""
        try:
            _send_frame(self._sock, dumps((False, (type(error).__name__, str(error)[:500]))))
        except OSError:
            pass

    def close(self) -> None:
        self._sock.close()
