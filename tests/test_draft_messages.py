"""Draft requests to a draft worker stay under the gRPC message cap, and draft as in-process.

The engine sends each Draft call the new (feature, token) pairs of its sequences; the head
runs over at most `TreeConfig.catch_up` of them (`Drafter._restart`). With EAGLE-3 features
of a large target (3 x 8192 values a position) one long prompt passed the 256 MiB cap. Here
a real gRPC DraftService (no Ray) is given a small cap and the client the same bound: every
request stays under it (features trimmed to what the head reads, rows split over calls, a
row too large alone trimmed further as a restart would), and the trees equal those of an
in-process drafter with the same head given the same (whole) inputs.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch
from conftest import tiny_target

from eagle2.config import TreeConfig
from eagle2.drafter import Drafter
from eagle2.head import new_head
from services import convert
from services.draft_client import RemoteDrafter
from services.draft_worker import DraftServicer, start_server

HIDDEN = 64  # fp32 features: 256 bytes a position
TREE = TreeConfig("eagle2", total_tokens=10, depth=3, top_k=3, budget="fixed", catch_up=16)


def new_drafter(target) -> Drafter:
    return Drafter(new_head(target.config, seed=0), target.embed, target.lm_head,
                   max_slots=4, max_len=256)


@pytest.fixture
def pair():
    """(an in-process drafter, a factory of RemoteDrafters to a worker with its own drafter
    of the same head, whose server caps messages at the bound given)."""
    target = tiny_target(hidden=HIDDEN, seed=3)
    servers = []

    def remote(bound: int) -> RemoteDrafter:
        server, port = start_server(DraftServicer(new_drafter(target), "test"), 0,
                                    max_message_bytes=bound)
        servers.append(server)
        client = RemoteDrafter(f"127.0.0.1:{port}", timeout_s=30, max_message_bytes=bound)
        sent = []
        draft = client.stub.Draft

        def recording(req, **kwargs):
            sent.append(req.ByteSize())
            return draft(req, **kwargs)

        client.stub.Draft = recording
        client.sent = sent
        return client

    yield new_drafter(target), remote
    for server in servers:
        server.stop(grace=None)


def steps(counts: list[int], seed: int = 0):
    """Two draft steps' inputs: first `counts` new pairs per row (prompts; tokens that repeat,
    so prompt lookup proposes chains from the whole history), then one pair per row."""
    gen = torch.Generator().manual_seed(seed)
    num_a = max(counts)
    feats = torch.randn(len(counts), num_a, HIDDEN, generator=gen)
    tokens = (torch.arange(num_a) % 7 + torch.arange(len(counts))[:, None] * 3) % 64
    for b, c in enumerate(counts):
        feats[b, c:] = 0  # the engine's padding
        tokens[b, c:] = 0
    first = (feats, tokens, torch.tensor(counts))
    second = (torch.randn(len(counts), 1, HIDDEN, generator=gen),
              torch.randint(0, 64, (len(counts), 1), generator=gen),
              torch.ones(len(counts), dtype=torch.long))
    return [first, second]


def request_bytes(features, tokens, counts, ids) -> int:
    """The size of the request the client sent before trimming: every position's features."""
    return draft_request(ids, features, tokens, counts).ByteSize()


def draft_request(ids, features, tokens, counts):
    from services.protos import draft_pb2

    return draft_pb2.DraftRequest(
        seq_ids=ids, features=convert.tensor_to_proto(features),
        tokens=convert.tensor_to_proto(tokens), counts=convert.tensor_to_proto(counts),
        tree=convert.tree_to_spec(TREE))


def assert_same_trees(got, expected):
    for name in ("tokens", "parents", "depths", "num_nodes", "values", "lookup", "tree_mask",
                 "retrieve_indices"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_long_prompts_are_trimmed_to_what_the_head_reads(pair):
    """Rows of 120 and 90 new positions and one of 5: whole, the request passes the bound
    (and the worker's cap: gRPC refuses it), trimmed to the last 16 positions it fits in one
    call, and the trees (and the next step's, the head's cache and prompt lookup's history
    after the restart) equal the in-process drafter's from the whole features."""
    local, remote = pair
    ids = ["a", "b", "c"]
    inputs = steps([120, 90, 5])
    whole = request_bytes(*inputs[0], ids)
    bound = 24 << 10
    assert whole > 3 * bound  # what the old client sent
    client = remote(bound)
    with pytest.raises(grpc.RpcError) as err:  # the cap is real
        client.stub.Draft(draft_request(ids, *inputs[0]), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    client.sent.clear()
    for step in inputs:
        assert_same_trees(client.draft(ids, *step, TREE), local.draft(ids, *step, TREE))
    assert len(client.sent) == 2 and max(client.sent) <= bound
    assert client.sent[0] < whole / 4
    assert client.largest_request == max(client.sent)


def test_a_batch_over_the_bound_is_split_into_calls(pair):
    """Trimmed, three rows still pass the bound: they go in calls of the rows that fit, and
    their trees (min_gain 0: rows draft independently) equal one in-process call's."""
    local, remote = pair
    ids = ["a", "b", "c"]
    inputs = steps([40, 60, 30], seed=1)
    bound = 10 << 10  # 16 positions x 256 bytes a row, and its tokens: two rows fit
    client = remote(bound)
    for step in inputs:
        assert_same_trees(client.draft(ids, *step, TREE), local.draft(ids, *step, TREE))
    assert len(client.sent) == 2 + 1 and max(client.sent) <= bound


def test_a_row_too_large_alone_restarts_from_fewer_positions(pair):
    """With catch_up 64 a row's features pass the bound by themselves: its call carries its
    last W < 64 positions and asks the worker's head for catch_up W, a restart from W
    positions, as an in-process drafter with catch_up W drafts (the row of 20 positions,
    alone in its call too, needs no restart either way); the next step goes in one call."""
    local, remote = pair
    tree = dataclasses.replace(TREE, catch_up=64)
    ids = ["a", "b"]
    (feats, tokens, counts), second = steps([100, 20], seed=2)
    bound = 12 << 10  # 64 positions (16 KiB) do not fit, ~40 do
    client = remote(bound)
    got = client.draft(ids, feats, tokens, counts, tree)
    assert max(client.sent) <= bound and len(client.sent) == 2
    width = (bound - client.OVERHEAD_BYTES - 100 * 8 - 16 - 1) // (HIDDEN * 4)
    assert 16 <= width < 64
    narrow = dataclasses.replace(tree, catch_up=width)
    want_a = local.draft(ids[:1], feats[:1], tokens[:1], counts[:1], narrow)
    want_b = local.draft(ids[1:], feats[1:], tokens[1:], counts[1:], tree)
    for b, want in enumerate((want_a, want_b)):
        n = int(want.num_nodes[0])
        assert int(got.num_nodes[b]) == n
        for name in ("tokens", "parents", "values", "lookup"):
            assert torch.equal(getattr(got, name)[b, :n], getattr(want, name)[0, :n]), name
    assert_same_trees(client.draft(ids, *second, tree), local.draft(ids, *second, tree))
    assert len(client.sent) == 3 and max(client.sent) <= bound


def test_features_of_the_last_positions_go_back_where_the_head_reads_them():
    features = torch.arange(2 * 5 * 2, dtype=torch.float32).reshape(2, 5, 2)
    features[1, 2:] = 0  # row 1: two valid positions, then padding
    counts = torch.tensor([5, 2])
    last = convert.last_positions(features, counts, 3)
    assert torch.equal(last[0], features[0, 2:5]) and torch.equal(last[1], features[1, :3])
    wide = convert.widen_positions(last, counts, 5)
    assert torch.equal(wide[0, 2:], features[0, 2:]) and not wide[0, :2].any()
    assert torch.equal(wide[1], features[1])
    assert convert.last_positions(features, counts, 5) is features
