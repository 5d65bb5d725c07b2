"""The engine's side of the draft hop: DrafterLikes that call DraftService over gRPC.

`RemoteDrafter` is one connection to one worker. `ResilientDrafter` survives the worker:
when a Draft call fails (the worker died, stalled past its deadline, or answered an error)
the sequences whose draft state lived there get one-node trees from then on, i.e. plain
decoding, which verification turns into exactly the target's output (lossless); a background
thread looks the worker's address up again (Serve restarts it on a new port) and reconnects,
and new sequences are speculated again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import grpc
import torch

from eagle2.config import TreeConfig
from eagle2.tree import DraftTree, root_only
from services import convert
from services.protos import draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)


class RemoteDrafter:
    """Sends (features, tokens) to the draft worker and returns its trees.

    A Draft request carries of the features only what the worker's head will run over:
    each row's last `TreeConfig.catch_up` positions (`convert.last_positions`; the tokens go
    whole, for prompt lookup's history), and no request is larger than max_message_bytes
    (`_plan`: rows split over several calls, a row too large even alone trimmed further as a
    restart of the head would). E.g. an EAGLE-3 head on a 70B target reads 3 x 8192 bf16
    values a position (48 KiB): one 8k-token prompt (384 MiB) had failed the 256 MiB cap."""

    def __init__(self, address: str, timeout_s: float = 60.0,
                 connect_timeout_s: float | None = None,
                 max_message_bytes: int = convert.MAX_MESSAGE_BYTES):
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", convert.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", max_message_bytes)])
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s or timeout_s)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise ConnectionError("draft worker not reachable") from None
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.calls = 0
        self.rpc_s = 0.0  # wall time of Draft calls, worker compute included
        self.bytes_sent = 0  # serialized DraftRequests
        self.bytes_received = 0  # serialized DraftResponses
        self.largest_request = 0  # bytes of the largest DraftRequest sent

    def draft(self, seq_ids: list[str], features: torch.Tensor, tokens: torch.Tensor,
              counts: torch.Tensor, config: TreeConfig, min_gain: float = 0.0) -> DraftTree:
        """features [B, A, F], tokens [B, A], counts [B] -> B trees, in one Draft call or,
        where one would pass max_message_bytes, several (`_plan`)."""
        tokens, counts = tokens.long().cpu(), counts.long().cpu()
        num_b = len(seq_ids)
        trees = []
        for first, stop, width, keep in self._plan(seq_ids, features, counts, config):
            # rows drafted apart stop expanding by their share of the batch's min_gain (the
            # bound's sum runs over the rows of one call: `Drafter.draft`)
            rows = slice(first, stop)  # (views: no copy of the features)
            trees.extend(self._call(seq_ids[rows], features[rows], tokens[rows], counts[rows],
                                    replace(config, catch_up=keep), width,
                                    min_gain * (stop - first) / num_b))
        return trees[0] if len(trees) == 1 else DraftTree.concat(trees)

    # bytes of a request besides its tensors' data: the tree spec, tensor headers, field tags
    OVERHEAD_BYTES = 512

    def _plan(self, seq_ids: list[str], features: torch.Tensor, counts: torch.Tensor,
              config: TreeConfig) -> list[tuple[int, int, int, int]]:
        """The calls to make, in row order: (first row, stop row, feature positions W a row
        carries, catch_up). W: the head's catch_up where a row has more new positions (all
        it reads of them), else every position. One call where the request stays within
        max_message_bytes, else runs of consecutive rows packed into calls that do; a row
        too large even alone carries fewer positions, W' >= 16, in a call of catch_up W'
        (the head restarts from its last W' positions: `Drafter._restart`, lossless as any
        catch-up). ValueError where even 16 positions of one row pass the bound."""
        num_a, hidden = features.shape[1], features.shape[2]
        keep = config.catch_up
        width = keep if keep and int(counts.max()) > keep else num_a
        per_position = hidden * features.element_size()

        def size(rows: int, positions: int) -> int:  # (ids: their longest, a bound)
            longest = max(len(s.encode()) for s in seq_ids)
            return self.OVERHEAD_BYTES + rows * (positions * per_position + num_a * 8 + 16 +
                                                 longest)

        bound = self.max_message_bytes
        if size(len(seq_ids), width) <= bound:
            return [(0, len(seq_ids), width, keep)]
        calls: list[tuple[int, int, int, int]] = []
        first = 0
        for b in range(len(seq_ids)):
            if size(b + 1 - first, width) <= bound:
                continue
            if b > first:
                calls.append((first, b, width, keep))
            first = b
            if size(1, width) > bound:  # alone too large: a shorter restart window
                fits = (bound - size(1, 0)) // per_position
                if fits < 16:
                    raise ValueError(f"one sequence's draft features ({per_position} bytes a "
                                     f"position) pass the {bound}-byte message bound even "
                                     f"at 16 positions")
                calls.append((b, b + 1, fits, fits))
                first = b + 1
        if first < len(seq_ids):
            calls.append((first, len(seq_ids), width, keep))
        return calls

    def _call(self, seq_ids: list[str], features: torch.Tensor, tokens: torch.Tensor,
              counts: torch.Tensor, config: TreeConfig, width: int,
              min_gain: float) -> list[DraftTree]:
        """One Draft call carrying each row's `width` feature positions
        (`convert.last_positions`) -> [its trees]; two calls of half the rows each where the
        serialized request still passes the bound (never sent)."""
        req = draft_pb2.DraftRequest(
            seq_ids=seq_ids,
            features=convert.tensor_to_proto(convert.last_positions(features, counts, width)),
            tokens=convert.tensor_to_proto(tokens), counts=convert.tensor_to_proto(counts),
            tree=convert.tree_to_spec(config), min_gain=min_gain)
        if req.ByteSize() > self.max_message_bytes:
            if len(seq_ids) == 1:
                raise ValueError(f"a Draft request of {req.ByteSize()} bytes passes the "
                                 f"{self.max_message_bytes}-byte message bound")
            half = len(seq_ids) // 2
            return [*self._call(seq_ids[:half], features[:half], tokens[:half], counts[:half],
                                config, width, min_gain * half / len(seq_ids)),
                    *self._call(seq_ids[half:], features[half:], tokens[half:], counts[half:],
                                config, width, min_gain * (len(seq_ids) - half) /
                                len(seq_ids))]
        t0 = time.perf_counter()
        try:
            resp = self.stub.Draft(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from e
            raise
        self.rpc_s += time.perf_counter() - t0
        self.calls += 1
        self.bytes_sent += req.ByteSize()
        self.bytes_received += resp.ByteSize()
        self.largest_request = max(self.largest_request, req.ByteSize())
        return [convert.draft_tree_from_proto(resp)]

    def release(self, seq_id: str) -> None:
        self.stub.Release(draft_pb2.ReleaseRequest(seq_ids=[seq_id]), timeout=self.timeout_s)

    def health(self) -> draft_pb2.HealthResponse:
        return self.stub.Health(draft_pb2.HealthRequest(), timeout=self.timeout_s)

    def close(self) -> None:
        self.channel.close()


class ResilientDrafter:
    """A RemoteDrafter that falls back to plain decoding while its worker is gone.

    lookup() returns the worker's current address (through Serve); it is called again after
    every failure, from a background thread, every retry_s seconds until a worker answers.
    """

    def __init__(self, lookup: Callable[[], str], timeout_s: float = 10.0,
                 retry_s: float = 1.0):
        self.lookup, self.timeout_s, self.retry_s = lookup, timeout_s, retry_s
        self.lock = threading.Lock()
        self.remote: RemoteDrafter | None = self._connect()
        self.held: set[str] = set()  # sequences whose draft state the current worker holds
        self.plain: set[str] = set()  # sequences that lost it: one-node trees until they end
        self.fallbacks = 0  # workers lost (each: its sequences decoded plainly)
        self.fallback_sequences = 0  # sequences that lost their draft state with a worker
        self.reconnects = 0
        self.last_recovery_s: float | None = None  # failure -> reconnected
        self.calls, self.rpc_s = 0, 0.0  # Draft calls that reached a worker, and their time
        self._closed = threading.Event()
        self._reconnecting: threading.Thread | None = None

    def _connect(self) -> RemoteDrafter:
        remote = RemoteDrafter(self.lookup(), timeout_s=self.timeout_s, connect_timeout_s=5.0)
        status = remote.health().status
        if status != "SERVING":  # e.g. its GPU failed: wait for Serve's replacement
            remote.close()
            raise ConnectionError(f"draft worker {status}")
        return remote

    # ----- DrafterLike ------------------------------------------------------------------------
    def draft(self, seq_ids: list[str], features: torch.Tensor, tokens: torch.Tensor,
              counts: torch.Tensor, config: TreeConfig, *options) -> DraftTree:
        """features [B, A, H], tokens [B, A], counts [B] -> B trees (one-node trees for the
        sequences without a worker). options: passed on to RemoteDrafter.draft as they are."""
        remote = self.remote
        spec = [b for b, s in enumerate(seq_ids) if remote is not None and s not in self.plain]
        parts: list[tuple[list[int], DraftTree]] = []
        if spec:
            # (every row: the tensors as they are, not a copy of all the features)
            rows = torch.tensor(spec) if len(spec) < len(seq_ids) else slice(None)
            t0 = time.perf_counter()
            self.held.update(seq_ids[b] for b in spec)  # the worker may hold state from now
            try:
                tree = remote.draft([seq_ids[b] for b in spec], features[rows], tokens[rows],
                                    counts[rows], config, *options)
                parts.append((spec, tree))
                self.calls += 1
                self.rpc_s += time.perf_counter() - t0
            except grpc.RpcError as e:
                self._lost(remote, e.code())
                spec = []
        plain = [b for b in range(len(seq_ids)) if b not in set(spec)]
        if plain:
            self.plain.update(seq_ids[b] for b in plain)  # their draft history now has a gap
            rows = torch.tensor(plain)
            parts.append((plain, root_only(tokens[rows, counts[rows] - 1])))
        if len(parts) == 1:
            return parts[0][1]
        order = torch.tensor([b for idx, _ in parts for b in idx])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return DraftTree.concat([t for _, t in parts]).select(inverse)

    def release(self, seq_id: str) -> None:
        self.plain.discard(seq_id)
        if seq_id not in self.held:
            return
        self.held.discard(seq_id)
        remote = self.remote
        if remote is None:
            return
        try:
            remote.release(seq_id)
        except grpc.RpcError as e:  # the next Draft call notices a lost worker
            log.debug("draft worker Release failed: %s", e.code())

    # ----- failure and recovery ---------------------------------------------------------------
    def _lost(self, remote: RemoteDrafter, code: grpc.StatusCode) -> None:
        with self.lock:
            if self.remote is not remote:
                return
            self.remote = None
            self.plain |= self.held
            self.fallback_sequences += len(self.held)
            self.held = set()
            self.fallbacks += 1
            self._lost_at = time.monotonic()
        remote.close()
        log.warning("draft worker lost (%s): %d sequences continue with plain decoding "
                    "(lossless); reconnecting", code.name, len(self.plain))
        self._reconnecting = threading.Thread(target=self._reconnect, name="draft-reconnect",
                                              daemon=True)
        self._reconnecting.start()

    def _reconnect(self) -> None:
        while not self._closed.wait(self.retry_s):
            try:
                remote = self._connect()
            except Exception as e:
                log.debug("draft worker not back yet: %s", type(e).__name__)
                continue
            with self.lock:
                self.remote = remote
                self.reconnects += 1
                self.last_recovery_s = time.monotonic() - self._lost_at
            log.warning("draft worker back after %.1f s: speculation resumes for new sequences",
                        self.last_recovery_s)
            return

    @property
    def connected(self) -> bool:
        return self.remote is not None

    def close(self) -> None:
        self._closed.set()
        if self.remote is not None:
            self.remote.close()
