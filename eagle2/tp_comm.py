"""The CPU ranks' collectives over local sockets: the all-reduce of the row-parallel layers and
the all-gather of the vocabulary-parallel lm_head (docs/tensor-parallel.md "Collectives").

On GPUs the ranks all-reduce with NCCL (`torch.distributed`). On CPUs gloo does it, but a
gloo op passes through the process group's worker thread and the transport's I/O thread on
every rank: where the ranks share a few busy cores, each of those handoffs waits for a core,
and a decode step makes two such ops a layer. Here a rank writes its tensor's bytes straight
to each peer's socket and reads theirs in the same thread (the production engines' CPU
backends likewise replace gloo for these, with shared memory: vLLM's and SGLang's shm
all-reduce; shared memory needs polling, which oversubscribed cores cannot afford).

Every rank sums the parts in rank order, so all ranks hold the same bits, as gloo's do. The
ranks of a group run on one node (the placement is STRICT_PACK): they connect over Unix
sockets (loopback TCP where there are none), after exchanging addresses over the process
group (`dist.all_gather_object`). A peer that dies closes its sockets, so a rank waiting for
it raises ConnectionError instead of waiting.
A rank that runs in the driver's process (docs/tensor-parallel.md "Rank 0 in the engine")
also watches the driver's connections to the other ranks (`watch`): a peer whose step raised
before its collectives reports it there, and the wait ends with `PeerAlert` instead of
waiting for a peer that will never write.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import sys
import time

import torch
import torch.distributed as dist

from eagle2.tp_channel import as_numpy, recv_exact, recv_into_exact

_RANK = struct.Struct("<Q")
# "unix" (where the platform has abstract Unix sockets, else TCP) or "tcp"
TRANSPORT = os.environ.get("EAGLE2_TP_TRANSPORT", "unix")


def _listen() -> socket.socket:
    """The socket this rank's peers connect to: a Unix socket in Linux's abstract namespace
    where there is one (the ranks share a node and its network namespace: one Ray node, one
    pod under KubeRay), whose writes skip the TCP stack (~1.6 against ~13 us a 256-byte write
    on a loopback TCP connection, measured on a 2-core Xeon); else TCP on the loopback
    interface. `TRANSPORT` "tcp" (env EAGLE2_TP_TRANSPORT) chooses TCP."""
    if TRANSPORT != "tcp" and sys.platform.startswith("linux"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"\0eagle2-tp-{os.getpid()}-{secrets.token_hex(8)}")  # no file to remove
            sock.listen()
            return sock
        except OSError:  # (a sandbox without abstract sockets): TCP; peers connect by address
            sock.close()
    return socket.create_server(("127.0.0.1", 0))


def _family(address) -> socket.AddressFamily:
    """The family of a listener's address: (host, port) for TCP, a name for a Unix socket."""
    return socket.AF_INET if isinstance(address, tuple) else socket.AF_UNIX


class PeerAlert(ConnectionError):
    """A watched connection (`SocketGroup.watch`) became readable or ended while this rank
    waited in a collective: another rank failed or reported an error."""


class SocketGroup:
    """A full mesh of connections between the world's ranks (pairs in rank order)."""

    def __init__(self, timeout_s: float = 1800.0):
        """Needs the torch.distributed process group (gloo): it carries the addresses."""
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        listener = _listen()
        addresses: list = [None] * self.world_size
        dist.all_gather_object(addresses, listener.getsockname())
        self.peers: dict[int, socket.socket] = {}
        for peer in range(self.rank):  # connect to the lower ranks, accept the higher ones
            sock = socket.socket(_family(addresses[peer]), socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            sock.connect(addresses[peer])
            sock.sendall(_RANK.pack(self.rank))
            self.peers[peer] = sock
        listener.settimeout(timeout_s)
        for _ in range(self.rank + 1, self.world_size):
            sock, _ = listener.accept()
            (peer,) = _RANK.unpack(recv_exact(sock, _RANK.size))
            self.peers[peer] = sock
        listener.close()
        # a peer that hangs fails the op (as gloo's timeout), by the kernel's timeouts on a
        # blocking socket: a read or write is then one system call (Python's own timeout
        # polls before each)
        self.io_timeout_s = timeout_s
        limit = struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6))  # struct timeval
        for sock in self.peers.values():
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
            if sock.family == socket.AF_INET:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout_s = timeout_s
        self.order = sorted(self.peers)
        # tensors up to this size are written to every peer before reading theirs: a
        # quarter of the smallest send buffer, room to spare for the kernel's bookkeeping
        self.eager_bytes = min((s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                                for s in self.peers.values()), default=0) // 4
        self._watched: frozenset[int] = frozenset()
        self._pollers: dict[int, select.poll] = {}
        # per peer: a buffer for the bytes it sends, reused; its views by (peer, shape, dtype)
        self._inbox: dict[int, torch.Tensor] = {}
        self._views: dict[tuple, tuple[torch.Tensor, memoryview]] = {}

    def watch(self, socks: list[socket.socket], timeout_s: float | None = None) -> None:
        """While waiting for a peer's bytes, also watch `socks` (the driver's connections to
        the other ranks, which they write to only to report an error, or close by dying): one
        that becomes readable or ends raises PeerAlert. [] stops watching. timeout_s: how long
        a receive may then wait for a peer (TimeoutError; None: as before)."""
        if timeout_s is not None:
            self.timeout_s = timeout_s
        self._watched = frozenset(s.fileno() for s in socks)
        self._pollers = {}
        if not socks:
            return
        for peer, sock in self.peers.items():
            poller = select.poll()
            for s in (sock, *socks):
                poller.register(s, select.POLLIN)
            self._pollers[peer] = poller

    def _wait(self, peer: int):
        """None, or what a receive from `peer` calls before each read while `watch` is on:
        it waits for the peer's bytes, raising PeerAlert when a watched connection becomes
        readable or ends first, TimeoutError after timeout_s."""
        poller = self._pollers.get(peer)
        if poller is None:
            return None
        deadline = time.monotonic() + self.timeout_s

        def wait() -> None:
            ready = poller.poll(max(deadline - time.monotonic(), 0) * 1000)
            if not ready:
                raise TimeoutError(f"rank {peer} sent nothing within {self.timeout_s} s")
            if any(fd in self._watched for fd, _ in ready):
                raise PeerAlert(f"rank {self.rank}: another rank failed while this one waited "
                                f"for rank {peer}")

        return wait

    def _recv(self, peer: int, like: torch.Tensor) -> torch.Tensor:
        """Peer's tensor of `like`'s shape and dtype, read into its inbox (valid until the
        next receive from it). The inbox's views of each shape are kept (a decode step's
        collectives repeat a few shapes), and dropped when it grows."""
        key = (peer, like.shape, like.dtype)
        got = self._views.get(key)
        if got is None:
            size = like.numel() * like.element_size()
            box = self._inbox.get(peer)
            if box is None or box.numel() < size:
                box = self._inbox[peer] = torch.empty(max(size, 4096), dtype=torch.uint8)
                self._views = {k: v for k, v in self._views.items() if k[0] != peer}
            if len(self._views) >= 64:
                self._views = {}
            got = self._views[key] = (box[:size].view(like.dtype).view(like.shape),
                                      memoryview(box.numpy())[:size])
        part, view = got
        recv_into_exact(self.peers[peer], view, self._wait(peer))
        return part

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype on all), in rank order; the peers' are views
        of their inboxes. A small tensor (it fits the sockets' buffers) goes to every peer
        before this rank reads theirs, so none waits for another to arrive before writing:
        an exchange costs the later rank no wait at all. Bigger ones go pair by pair in a
        global order (lower rank, higher rank), the lower rank writing first, so that two
        ranks cannot both block writing."""
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        out = as_numpy(t)
        parts: list[torch.Tensor | None] = [None] * self.world_size
        parts[self.rank] = t
        peer = None
        try:
            if out.nbytes <= self.eager_bytes:
                for peer in self.order:
                    self.peers[peer].sendall(out)
                for peer in self.order:
                    parts[peer] = self._recv(peer, t)
                return parts
            for peer in self.order:
                if self.rank < peer:
                    self.peers[peer].sendall(out)
                    parts[peer] = self._recv(peer, t)
                else:
                    parts[peer] = self._recv(peer, t)
                    self.peers[peer].sendall(out)
        except BlockingIOError as e:  # the socket's timeout ran out (EAGAIN)
            raise TimeoutError(f"rank {self.rank}: rank {peer} neither sent nor took bytes "
                               f"within {self.io_timeout_s} s") from e
        return parts

    def all_reduce(self, t: torch.Tensor) -> None:
        """t <- the sum of every rank's t (in rank order: the same bits on every rank)."""
        if t.numel() == 0:
            return
        parts = self._exchange(t)
        if len(parts) == 2:  # a + b and b + a are the same bits: add the peer's in place
            t.add_(parts[1 - self.rank])
            return
        total = parts[0] + parts[1]
        for part in parts[2:]:
            total += part
        t.copy_(total)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's t, in rank order, without copies: the peers' are views of their
        inboxes, valid until the next collective."""
        return self._exchange(t)

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        self.peers, self._pollers, self._watched = {}, {}, frozenset()
        self._inbox, self._views = {}, {}
