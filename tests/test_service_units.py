"""Service pieces without Ray: request limits, seeds, body parsing, and the draft hop's
fallback to plain decoding when the draft worker dies (real gRPC servers, tiny target)."""

from __future__ import annotations

import pytest

from eagle2.config import SamplingParams, TreeConfig
from eagle2.engine import Request, fold_seed
from tests.conftest import make_engine, random_prompts, run, tiny_target

pytest.importorskip("grpc")

from services import convert
from services.protos import MalformedRequest, _lenient, eagle2_pb2

LIMITS = dict(max_prompt_bytes=100, max_chat_messages=3, max_stop_sequences=2,
              max_stop_bytes=5)


def test_fold_seed_keeps_32_bit_seeds_and_uses_the_high_bits():
    assert [fold_seed(s) for s in (0, 1, 2**32 - 1)] == [0, 1, 2**32 - 1]
    folded = {fold_seed(1 + (k << 32)) for k in range(1000)}
    assert len(folded) == 1000 and all(0 <= f < 2**32 for f in folded)
    assert 0 <= fold_seed(-(2**63)) < 2**32


def test_seeds_differing_in_high_bits_sample_differently():
    target = tiny_target(seed=3)
    engine = make_engine(target, head_seed=None)
    params = SamplingParams(temperature=1.0, max_tokens=16)
    prompt = [random_prompts(1, 64, seed=4)[0]]
    vanilla = TreeConfig("vanilla")
    a = run(engine, prompt, params, vanilla, seeds=[5])
    b = run(engine, prompt, params, vanilla, seeds=[5 + (1 << 40)])
    assert a == run(engine, prompt, params, vanilla, seeds=[5])
    assert a != b


@pytest.mark.parametrize("build, message", [
    (lambda r: setattr(r, "text", "x" * 101), "bytes"),
    (lambda r: r.chat.messages.extend(
        [eagle2_pb2.ChatMessage(role="user", content="hi")] * 4), "messages"),
    (lambda r: r.stop.extend(["a", "b", "c"]), "stop strings"),
    (lambda r: r.stop.append("toolong"), "stop string"),
])
def test_raw_limits_are_checked_before_tokenizing(build, message):
    req = eagle2_pb2.GenerateRequest(text="hi")
    build(req)
    with pytest.raises(ValueError, match=message):
        convert.check_request_size(req, **LIMITS)


def test_chat_roles_are_validated():
    req = eagle2_pb2.GenerateRequest()
    req.chat.messages.append(eagle2_pb2.ChatMessage(role="root", content="hi"))
    with pytest.raises(ValueError, match="role"):
        convert.prompt_from_request(req)
    req.chat.messages[0].role = "user"
    assert convert.prompt_from_request(req) == [{"role": "user", "content": "hi"}]


def test_malformed_body_parses_to_a_marker_not_an_exception():
    parse = _lenient(eagle2_pb2.GenerateRequest)
    good = eagle2_pb2.GenerateRequest(text="hi", max_tokens=3)
    assert parse(good.SerializeToString()) == good
    bad = parse(b"\xff\xff\xff\xff")
    assert isinstance(bad, MalformedRequest) and bad.num_bytes == 4


# ----- the draft hop: worker killed mid-generation ----------------------------------------------
class Worker:
    """A DraftService on localhost (what the DraftWorker replica runs) around a fresh head."""

    def __init__(self, target, head_seed: int = 0):
        from eagle2.drafter import Drafter
        from eagle2.head import new_head
        from services.draft_worker import DraftServicer, start_server

        head = new_head(target.config, seed=head_seed)
        self.servicer = DraftServicer(Drafter(head, target.embed, target.lm_head, max_slots=16,
                                              max_len=512), "test")
        self.server, port = start_server(self.servicer, 0)
        self.address = f"127.0.0.1:{port}"

    def kill(self) -> None:
        self.server.stop(grace=None)


def engine_on_a_worker(target):
    """(a draft worker, {"address": what the drafter's lookup answers}, the engine's
    ResilientDrafter to it, an engine drafting through it)."""
    from services.draft_client import ResilientDrafter

    worker = Worker(target)
    current = {"address": worker.address}
    drafter = ResilientDrafter(lambda: current["address"], timeout_s=5.0, retry_s=0.05)
    engine = make_engine(target, head_seed=None)
    engine.drafter = drafter
    return worker, current, drafter, engine


def test_draft_worker_loss_falls_back_to_plain_decoding_and_reconnects():
    target = tiny_target(seed=1)
    worker, current, drafter, engine = engine_on_a_worker(target)
    plain_engine = make_engine(target, head_seed=None)
    prompts = random_prompts(3, 64, seed=2)
    params = SamplingParams(max_tokens=40)
    expected = run(plain_engine, prompts, params, TreeConfig("vanilla"))
    # a fixed tree: drafted every step (an auto budget may back off past the kill with a
    # random head, and then never call the dead worker)
    tree = TreeConfig("eagle2", total_tokens=8, depth=3, top_k=3, budget="fixed")

    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add(Request(f"s{i}", tuple(p), params, tree))
        out[f"s{i}"] = []
    for _ in range(3):  # a few speculative steps, then the worker dies
        for ev in engine.step():
            out[ev.seq_id].extend(ev.token_ids)
    calls_before = worker.servicer.draft_requests
    assert calls_before >= 1
    worker.kill()
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].extend(ev.token_ids)
    assert [out[f"s{i}"] for i in range(3)] == expected  # nothing lost or altered
    assert drafter.fallbacks == 1 and drafter.fallback_sequences == 3

    second = Worker(target)  # Serve's replacement: a new process on a new port
    current["address"] = second.address
    drafter._reconnecting.join(timeout=30)
    assert drafter.connected and drafter.reconnects == 1 and drafter.last_recovery_s > 0
    assert run(engine, prompts, params, tree) == expected
    assert second.servicer.draft_requests >= 1  # speculation resumed on the new worker
    drafter.close()
    second.kill()


def test_a_draft_worker_whose_gpu_failed_refuses_until_replaced():
    """A draft that loses the GPU's CUDA context (`torch.AcceleratorError`, raised by the
    drafter here): the call fails UNAVAILABLE and the engine's drafter falls back to plain
    decoding (outputs unchanged); the worker then refuses every draft UNAVAILABLE, answers
    Health NOT_SERVING and fails Serve's health check (`DraftWorker.check_health`), and the
    engine's drafter does not reconnect to it, only to its replacement."""
    import time
    import types

    import grpc
    import torch

    from services.draft_client import RemoteDrafter
    from services.draft_worker import DraftWorker

    target = tiny_target(seed=1)
    worker, current, drafter, engine = engine_on_a_worker(target)
    prompts = random_prompts(2, 64, seed=3)
    params = SamplingParams(max_tokens=24)
    expected = run(make_engine(target, head_seed=None), prompts, params, TreeConfig("vanilla"))
    tree = TreeConfig("eagle2", total_tokens=8, depth=3, top_k=3, budget="fixed")

    def lost(*args, **kwargs):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    worker.servicer.drafter.draft = lost
    assert run(engine, prompts, params, tree) == expected
    assert drafter.fallbacks == 1 and not drafter.connected
    assert worker.servicer.device_failed.startswith("AcceleratorError")
    probe = RemoteDrafter(worker.address, timeout_s=5.0)
    assert probe.health().status == "NOT_SERVING"
    with pytest.raises(grpc.RpcError) as err:
        probe.draft(["x"], torch.zeros(1, 1, target.config.hidden_size),
                    torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), tree)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "GPU failed" in err.value.details()
    probe.close()
    replica = types.SimpleNamespace(_address=worker.address, servicer=worker.servicer)
    with pytest.raises(RuntimeError, match="NOT_SERVING"):
        DraftWorker.func_or_class.check_health(replica)
    time.sleep(0.5)  # ten retries: none connects to the failed worker
    assert not drafter.connected and drafter.reconnects == 0
    second = Worker(target)  # Serve's replacement
    current["address"] = second.address
    drafter._reconnecting.join(timeout=30)
    assert drafter.connected and drafter.reconnects == 1
    assert run(engine, prompts, params, tree) == expected
    assert second.servicer.draft_requests >= 1
    drafter.close()
    worker.kill()
    second.kill()


def test_api_keys_from_file_and_env(tmp_path, monkeypatch):
    from services import auth

    path = tmp_path / "keys"
    path.write_text("# comment\nalpha\n\n")
    monkeypatch.setenv("TEST_KEYS", "beta, gamma")
    digests = auth.load_keys(str(path), "TEST_KEYS")
    assert len(digests) == 3
    for key in ("alpha", "beta", "gamma"):
        auth.check([("authorization", f"Bearer {key}")], digests)
    for metadata, code in (([], "UNAUTHENTICATED"), ([("authorization", "alpha")],
                                                     "UNAUTHENTICATED"),
                           ([("authorization", "Bearer delta")], "PERMISSION_DENIED")):
        with pytest.raises(auth.AuthError) as err:
            auth.check(metadata, digests)
        assert err.value.code_name == code and "alpha" not in err.value.message
    auth.check([], [])  # no keys configured: open
    path.write_text("# none\n")
    with pytest.raises(ValueError, match="no keys"):
        auth.load_keys(str(path), None)


def test_exceptions_map_to_statuses_without_internal_details():
    import grpc
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    from services.router import to_request_error

    cases = [(ValueError("max_tokens must be ..."), grpc.StatusCode.INVALID_ARGUMENT),
             (BackPressureError(num_queued_requests=3, max_queued_requests=2),
              grpc.StatusCode.RESOURCE_EXHAUSTED),
             (ActorDiedError(), grpc.StatusCode.UNAVAILABLE),
             (KeyError("actor 5f3a at 10.0.0.7:41234 pid 999"), grpc.StatusCode.INTERNAL)]
    for exc, code in cases:
        err = to_request_error(exc)
        assert err.code == code
        assert "10.0.0.7" not in err.message and "pid" not in err.message


def test_target_placement_resolves_by_tp_size_and_device():
    """auto: the whole target (tp 1) or rank 0 of it (CPU ranks) in the engine replica; GPU
    ranks all on actors, where "engine" at tp > 1 is refused."""
    from services.config import ServiceConfig

    assert ServiceConfig().resolved_target_placement() == "engine"
    assert ServiceConfig().target_in_engine() and not ServiceConfig().rank0_in_engine()
    tp2 = ServiceConfig(tp_size=2)
    assert tp2.resolved_target_placement() == "engine"
    assert tp2.rank0_in_engine() and not tp2.target_in_engine()
    assert ServiceConfig(tp_size=2, use_gpu=True).resolved_target_placement() == "ranks"
    assert ServiceConfig(tp_size=1, use_gpu=True).target_in_engine()
    assert not ServiceConfig(target_placement="ranks").target_in_engine()
    assert not ServiceConfig(target_placement="ranks", tp_size=2).rank0_in_engine()
    assert ServiceConfig(target_placement="engine").target_in_engine()
    assert ServiceConfig(target_placement="engine", tp_size=2).rank0_in_engine()
    with pytest.raises(ValueError, match=r"target_placement 'engine' at tp_size 2 .* only CPU"):
        ServiceConfig(target_placement="engine", tp_size=2, use_gpu=True)


def test_engine_replica_reserves_the_targets_resources_only_when_it_holds_it():
    pytest.importorskip("ray")
    from services.app import engine_resources
    from services.config import ServiceConfig

    def res(**kw):
        return engine_resources(ServiceConfig(**kw))

    assert res(cpus_per_rank=4) == {"num_cpus": 4, "num_gpus": 0}
    assert res(cpus_per_rank=4, target_placement="ranks") == {"num_cpus": 1, "num_gpus": 0}
    assert res(cpus_per_rank=2, tp_size=2) == {"num_cpus": 2, "num_gpus": 0}  # rank 0 here
    assert res(cpus_per_rank=2, tp_size=2, target_placement="ranks") == \
        {"num_cpus": 1, "num_gpus": 0}
    assert res(use_gpu=True) == {"num_cpus": 1, "num_gpus": 1.0}
    assert res(use_gpu=True, draft_gpu_fraction=0.1) == {"num_cpus": 1, "num_gpus": 0.9}
    assert res(use_gpu=True, tp_size=4) == {"num_cpus": 1, "num_gpus": 0}  # ranks have them
    assert res(use_gpu=True, draft_placement="inprocess",
               draft_gpu_fraction=0.1)["num_gpus"] == 1.0  # head and target share one GPU


def test_an_engine_beside_a_draft_worker_reads_the_heads_lookup_table(tmp_path):
    """With the head in another process, the engine's lookup chains (steps without a draft
    call) take the head's fitted table from its calibration.json; an untrained head or a
    directory without the file leaves the conservative default."""
    import shutil

    from eagle2.api import shipped_head_dir
    from eagle2.calibration import Calibration
    from eagle2.target import EMBEDDED_NAME
    from services.config import ServiceConfig
    from services.draft_worker import lookup_table

    shipped = shipped_head_dir(EMBEDDED_NAME)
    want = Calibration.load(shipped / "calibration.json").lookup
    assert want is not None and lookup_table(ServiceConfig()) == want
    assert lookup_table(ServiceConfig(draft="untrained")) is None
    bare = tmp_path / "head"
    shutil.copytree(shipped, bare)
    (bare / "calibration.json").unlink()
    assert lookup_table(ServiceConfig(draft=str(bare))) is None


def test_an_engine_beside_a_draft_worker_reads_the_heads_ngram_store(tmp_path):
    """The n-gram store shipped beside the head reaches an engine whose drafter is remote (its
    lookup-only steps propose from it); a head directory without the file gives none."""
    import shutil

    from eagle2.api import shipped_head_dir
    from eagle2.ngram import FILE_NAME, NgramStore
    from eagle2.target import EMBEDDED_NAME
    from services.config import ServiceConfig
    from services.draft_worker import ngram_store

    shipped = shipped_head_dir(EMBEDDED_NAME)
    store = ngram_store(ServiceConfig())
    want = NgramStore.load(shipped / FILE_NAME)
    assert store is not None and len(store) == len(want) > 100_000
    assert (store.rates == want.rates).all()
    assert ngram_store(ServiceConfig(draft="untrained")) is None
    bare = tmp_path / "head"
    shutil.copytree(shipped, bare)
    (bare / FILE_NAME).unlink()
    assert ngram_store(ServiceConfig(draft=str(bare))) is None


def test_the_engine_replicas_cpu_target_takes_the_measured_count_and_follows_the_load(
        monkeypatch):
    """engine_threads "auto": the cached (else measured) count, the cost cache of that
    count, and a load follower where it is above one; EAGLE2_THREADS wins and is not
    followed (OMP_NUM_THREADS, which Ray sets per actor, is not the user's)."""
    from types import SimpleNamespace

    import torch

    from eagle2 import threads as thr
    from services.config import ServiceConfig
    from services.engine import TargetEngine, _cost_path

    assert ServiceConfig(engine_threads=None).engine_threads is None  # cpus_per_rank's
    cfg = ServiceConfig()
    assert cfg.engine_threads == "auto"
    assert cfg.target_in_engine() and ServiceConfig(engine_threads=3).engine_threads == 3
    for bad in (0, -1, "many"):
        with pytest.raises(ValueError):
            ServiceConfig(engine_threads=bad)
    target = tiny_target(seed=3)
    before = torch.get_num_threads()
    try:
        for env, cached, want, follows in ((None, 2, 2, True), ("1", 2, 1, False),
                                           (None, 1, 1, False)):
            if env is None:
                monkeypatch.delenv("EAGLE2_THREADS", raising=False)
            else:
                monkeypatch.setenv("EAGLE2_THREADS", env)
            monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as Ray sets it
            monkeypatch.setattr(thr, "cached", lambda t, c=cached: c)
            engine = make_engine(target, head_seed=None)
            runner = engine.runner
            replica = SimpleNamespace(cfg=cfg, placement="engine", engine=engine,
                                      cost_path=None)
            torch.set_num_threads(3 - want)
            TargetEngine.func_or_class._auto_threads(replica, runner)
            assert torch.get_num_threads() == want
            assert replica.cost_path == _cost_path(cfg, "engine", runner.info)
            assert engine._cost_path == replica.cost_path
            assert (engine.threads is not None) == follows
            if follows:
                assert engine.threads.most == want
    finally:
        torch.set_num_threads(before)


def test_a_draft_share_that_would_let_two_ranks_share_a_gpu_is_refused():
    """Ranks asking for 1 - draft_gpu_fraction <= 0.5 of a GPU could be packed two to a GPU by
    Ray, where NCCL refuses the group: the config says so before anything starts."""
    from services.config import ServiceConfig

    with pytest.raises(ValueError, match="two ranks could share one"):
        ServiceConfig(use_gpu=True, tp_size=2, draft_gpu_fraction=0.5)
    assert ServiceConfig(use_gpu=True, tp_size=2, draft_gpu_fraction=0.45).gpu_per_rank() == 0.55
    assert ServiceConfig(use_gpu=True, tp_size=1, draft_gpu_fraction=0.5).gpu_per_rank() == 0.5
    assert ServiceConfig(use_gpu=False, tp_size=2, draft_gpu_fraction=0.5).gpu_per_rank() == 0.0
