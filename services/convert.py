"""The one place where protobuf messages meet the core's dataclasses and tensors."""

from __future__ import annotations

import numpy as np
import torch

from eagle2.config import SamplingParams, TreeConfig
from eagle2.tree import DraftTree, finish_tree
from services.protos import draft_pb2, eagle2_pb2

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
# gRPC's cap on one message between the engine and the draft worker, both ways (their channel
# and server options); the engine keeps its Draft requests under it (`RemoteDrafter`)
MAX_MESSAGE_BYTES = 256 << 20


def tensor_to_proto(t: torch.Tensor) -> draft_pb2.Tensor:
    t = t.detach().contiguous().cpu()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"cannot send dtype {t.dtype}")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
    return draft_pb2.Tensor(data=raw.numpy().tobytes(), dtype=name, shape=list(t.shape))


def tensor_from_proto(msg: draft_pb2.Tensor) -> torch.Tensor:
    if msg.dtype not in _DTYPES:
        raise ValueError(f"unknown tensor dtype {msg.dtype!r}")
    dtype = _DTYPES[msg.dtype]
    np_dtype = np.int16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
    arr = np.frombuffer(msg.data, dtype=np_dtype).reshape(tuple(msg.shape))
    t = torch.from_numpy(arr.copy())
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def last_positions(features: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """features [B, A, F] (row b valid up to counts[b], right-padded) -> [B, W, F] with
    W = min(width, A): row b's positions [s_b, s_b + W), s_b = max(counts[b] - W, 0), i.e.
    its last W positions, or its first W (valid and padding) when it has no more. These are
    all a draft call whose head keeps W positions reads (`Drafter._restart`, TreeConfig
    catch_up W): what a DraftRequest needs to carry of the features. E.g. counts [5, 2],
    W 3: positions 2..4 of row 0, 0..2 of row 1."""
    num_b, num_a, hidden = features.shape
    if width >= num_a:
        return features
    idx = _window(counts, width, features.device)  # [B, W]
    return features.gather(1, idx[:, :, None].expand(num_b, width, hidden))


def _window(counts: torch.Tensor, width: int, dev: torch.device) -> torch.Tensor:
    """[B, W] the positions [s_b, s_b + W) of `last_positions`, s_b = max(counts[b] - W, 0)."""
    start = (counts.to(dev) - width).clamp(min=0)  # [B]
    return start[:, None] + torch.arange(width, device=dev)


def widen_positions(features: torch.Tensor, counts: torch.Tensor, num_a: int) -> torch.Tensor:
    """`last_positions` undone where a draft call keeping W positions reads: [B, W, F] ->
    [B, A, F] with row b's W features at [s_b, s_b + W) and zeros elsewhere (positions such
    a call never reads; the engine's own padding is zeros too)."""
    num_b, width, hidden = features.shape
    if width >= num_a:
        return features
    idx = _window(counts, width, features.device)  # [B, W]
    full = features.new_zeros(num_b, num_a, hidden)
    return full.scatter_(1, idx[:, :, None].expand(num_b, width, hidden), features)


def tree_to_spec(cfg: TreeConfig) -> draft_pb2.TreeSpec:
    return draft_pb2.TreeSpec(mode=cfg.mode, total_tokens=cfg.total_tokens, depth=cfg.depth,
                              top_k=cfg.top_k, draft_window=cfg.draft_window, budget=cfg.budget,
                              lookup=cfg.lookup, catch_up=cfg.catch_up)


def tree_from_spec(spec: draft_pb2.TreeSpec) -> TreeConfig:
    # fields a client older than them leaves unset: the defaults
    optional = {f: getattr(spec, f) for f in ("lookup", "catch_up") if spec.HasField(f)}
    return TreeConfig(spec.mode, spec.total_tokens, spec.depth, spec.top_k, spec.draft_window,
                      spec.budget or "auto", **optional)


def draft_tree_to_proto(tree: DraftTree) -> draft_pb2.DraftResponse:
    return draft_pb2.DraftResponse(tokens=tensor_to_proto(tree.tokens),
                                   parents=tensor_to_proto(tree.parents),
                                   depths=tensor_to_proto(tree.depths),
                                   num_nodes=tensor_to_proto(tree.num_nodes),
                                   values=tensor_to_proto(tree.values.float()),
                                   lookup=tensor_to_proto(tree.lookup))


def draft_tree_from_proto(msg: draft_pb2.DraftResponse) -> DraftTree:
    values = tensor_from_proto(msg.values) if msg.HasField("values") else None
    lookup = tensor_from_proto(msg.lookup) if msg.HasField("lookup") else None
    return finish_tree(tensor_from_proto(msg.tokens), tensor_from_proto(msg.parents),
                       tensor_from_proto(msg.depths), tensor_from_proto(msg.num_nodes), values,
                       lookup)


def sampling_from_request(req: eagle2_pb2.GenerateRequest, default_max_tokens: int,
                          max_tokens_limit: int) -> SamplingParams:
    """Validate the request's sampling fields (ValueError says which one is wrong)."""
    max_tokens = req.max_tokens if req.HasField("max_tokens") else default_max_tokens
    if not 1 <= max_tokens <= max_tokens_limit:
        raise ValueError(f"max_tokens must be in [1, {max_tokens_limit}], got {max_tokens}")
    return SamplingParams(
        temperature=req.temperature if req.HasField("temperature") else 0.0,
        top_p=req.top_p if req.HasField("top_p") else 1.0,
        top_k=req.top_k if req.HasField("top_k") else 0,
        seed=req.seed if req.HasField("seed") else None,
        max_tokens=max_tokens,
        stop=tuple(req.stop),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
    )


def logprobs_to_proto(entries: list | None) -> list[eagle2_pb2.TokenLogprob]:
    """The engine's (token id, log-probability, [(id, log-probability)]) triples of a
    message's tokens as TokenLogprob messages (none where the request did not ask)."""
    return [eagle2_pb2.TokenLogprob(token_id=t, logprob=lp, top=[
        eagle2_pb2.TopLogprob(token_id=i, logprob=v) for i, v in top])
        for t, lp, top in entries or ()]


CHAT_ROLES = ("system", "user", "assistant")


def check_request_size(req: eagle2_pb2.GenerateRequest, max_prompt_bytes: int,
                       max_chat_messages: int, max_stop_sequences: int,
                       max_stop_bytes: int) -> None:
    """Raw size limits, checked before anything is tokenized (ValueError names the limit)."""
    kind = req.WhichOneof("input")
    if kind == "text":
        size = len(req.text.encode())
    elif kind == "chat":
        if len(req.chat.messages) > max_chat_messages:
            raise ValueError(f"chat has {len(req.chat.messages)} messages; the limit is "
                             f"{max_chat_messages}")
        size = sum(len(m.content.encode()) + len(m.role.encode()) for m in req.chat.messages)
    else:
        size = 0  # token ids: checked against the context length
    if size > max_prompt_bytes:
        raise ValueError(f"prompt has {size} bytes; the limit is {max_prompt_bytes}")
    if len(req.stop) > max_stop_sequences:
        raise ValueError(f"{len(req.stop)} stop strings; the limit is {max_stop_sequences}")
    if any(len(s.encode()) > max_stop_bytes for s in req.stop):
        raise ValueError(f"a stop string is longer than the limit of {max_stop_bytes} bytes")


def prompt_from_request(req: eagle2_pb2.GenerateRequest) -> str | list[dict] | list[int]:
    """The prompt as text, chat messages or token ids (ValueError if missing/empty)."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise ValueError("no input: set one of text, chat or token_ids")
    if kind == "text":
        if not req.text:
            raise ValueError("empty prompt: text is empty")
        return req.text
    if kind == "chat":
        if not req.chat.messages:
            raise ValueError("empty prompt: chat has no messages")
        for m in req.chat.messages:
            if m.role not in CHAT_ROLES:
                raise ValueError(f"chat message role must be one of {CHAT_ROLES}, got "
                                 f"{m.role[:32]!r}")
        return [{"role": m.role, "content": m.content} for m in req.chat.messages]
    if not req.token_ids.ids:
        raise ValueError("empty prompt: token_ids is empty")
    return list(req.token_ids.ids)


FINISH = {"stop": eagle2_pb2.FINISH_REASON_STOP, "length": eagle2_pb2.FINISH_REASON_LENGTH}


def stats_to_proto(mode: str, num_steps: int, num_tokens: int,
                   accepted: dict[int, int]) -> eagle2_pb2.SpeculationStats:
    depth = max(accepted, default=-1) + 1
    return eagle2_pb2.SpeculationStats(
        mode=mode, num_steps=num_steps, tau=num_tokens / max(num_steps, 1),
        accepted_at_depth=[accepted.get(d, 0) for d in range(depth)])
