"""The engine's side of the draft hop: a DrafterLike that calls DraftService over gRPC."""

from __future__ import annotations

import time

import grpc
import torch

from eagle2.config import TreeConfig
from eagle2.tree import DraftTree
from services import convert
from services.protos import draft_pb2, draft_pb2_grpc


class RemoteDrafter:
    """Sends (features, tokens) to the draft worker and returns its trees."""

    def __init__(self, address: str, timeout_s: float = 60.0):
        self.address = address
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", 256 << 20),
            ("grpc.max_send_message_length", 256 << 20)])
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.calls = 0
        self.rpc_s = 0.0  # wall time of Draft calls, worker compute included
        self.bytes_sent = 0  # serialized DraftRequests
        self.bytes_received = 0  # serialized DraftResponses

    def draft(self, seq_ids: list[str], features: torch.Tensor, tokens: torch.Tensor,
              counts: torch.Tensor, config: TreeConfig, min_gain: float = 0.0) -> DraftTree:
        req = draft_pb2.DraftRequest(
            seq_ids=seq_ids, features=convert.tensor_to_proto(features),
            tokens=convert.tensor_to_proto(tokens.long()),
            counts=convert.tensor_to_proto(counts.long()), tree=convert.tree_to_spec(config),
            min_gain=min_gain)
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
        return convert.draft_tree_from_proto(resp)

    def release(self, seq_id: str) -> None:
        self.stub.Release(draft_pb2.ReleaseRequest(seq_ids=[seq_id]), timeout=self.timeout_s)

    def health(self) -> draft_pb2.HealthResponse:
        return self.stub.Health(draft_pb2.HealthRequest(), timeout=self.timeout_s)
