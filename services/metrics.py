"""Service metrics through Ray's metrics API (`ray.util.metrics`), exported on every node's
Prometheus endpoint (`ray.init(_metrics_export_port=...)`; Ray prefixes each name with
`ray_`). Names follow vLLM's and SGLang's speculative-decoding metrics where one exists:

  router:  eagle2_requests_total{status}, eagle2_time_to_first_token_seconds,
           eagle2_inter_token_latency_seconds, eagle2_generation_tokens_total,
           eagle2_prompt_tokens_total
  engine:  eagle2_num_requests_running, eagle2_num_requests_waiting,
           eagle2_spec_decode_num_drafts_total, eagle2_spec_decode_num_accepted_tokens_total,
           eagle2_spec_decode_num_accepted_tokens_per_pos_total{position},
           eagle2_spec_decode_acceptance_length, eagle2_draft_worker_fallbacks_total,
           eagle2_draft_worker_reconnects_total, eagle2_tp_rank_restarts_total,
           eagle2_kv_cache_usage_perc, eagle2_num_preemptions_total,
           eagle2_prefix_cache_queries_total, eagle2_prefix_cache_hits_total

Acceptance length is tokens per target forward (accepted draft tokens + the bonus token),
the tau of docs/architecture.md; position p counts steps that accepted the draft token at depth
p + 1. The cache's series (docs/kv-cache.md "Paged cache") are vLLM's: the fraction of the
paged cache's blocks in use (0 where slotted), requests preempted, and prompt tokens looked up
in the prefix cache and found there.
"""

from __future__ import annotations

import threading
from collections import Counter

from ray.util import metrics

_LATENCY_S = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0]
_LENGTHS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16]


class RouterMetrics:
    def __init__(self):
        self.requests = metrics.Counter("eagle2_requests_total",
                                        "Finished requests by gRPC status.", ("status",))
        self.ttft = metrics.Histogram("eagle2_time_to_first_token_seconds",
                                      "Request arrival to first token.", _LATENCY_S)
        self.itl = metrics.Histogram("eagle2_inter_token_latency_seconds",
                                     "Time between streamed messages over the tokens each "
                                     "carries (one observation per message: a step's tokens "
                                     "arrive together).", _LATENCY_S)
        self.generation_tokens = metrics.Counter("eagle2_generation_tokens_total",
                                                 "Tokens generated.")
        self.prompt_tokens = metrics.Counter("eagle2_prompt_tokens_total", "Prompt tokens.")

    def finished(self, status: str) -> None:
        self.requests.inc(1, {"status": status})


class EngineMetrics:
    """The engine's series. The step loop only counts into plain Python numbers (`step`,
    `drafter`: a few additions per step, no Ray call); `flush`, called about once a second
    from a thread of its own (`TargetEngine._flush_metrics`), hands the sums to Ray's metrics,
    so recording them costs the step nothing beyond the additions."""

    def __init__(self, max_depth: int = 16):
        self.running = metrics.Gauge("eagle2_num_requests_running",
                                     "Sequences in the running batch.")
        self.waiting = metrics.Gauge("eagle2_num_requests_waiting",
                                     "Admitted sequences not running: waiting, preempted, or "
                                     "prefilled in chunks.")
        self.drafts = metrics.Counter("eagle2_spec_decode_num_drafts_total",
                                      "Speculative steps (one per sequence per step).")
        self.accepted = metrics.Counter("eagle2_spec_decode_num_accepted_tokens_total",
                                        "Draft tokens accepted.")
        self.accepted_per_pos = metrics.Counter(
            "eagle2_spec_decode_num_accepted_tokens_per_pos_total",
            "Steps that accepted the draft token at this position (0 = first).", ("position",))
        self.acceptance_length = metrics.Histogram(
            "eagle2_spec_decode_acceptance_length",
            "Tokens per target forward (accepted + bonus).", _LENGTHS)
        self.fallbacks = metrics.Counter("eagle2_draft_worker_fallbacks_total",
                                         "Draft workers lost (plain decoding took over).")
        self.reconnects = metrics.Counter("eagle2_draft_worker_reconnects_total",
                                          "Reconnections to a restarted draft worker.")
        self.rank_restarts = metrics.Counter("eagle2_tp_rank_restarts_total",
                                             "Tensor-parallel rank groups rebuilt.")
        self.kv_usage = metrics.Gauge("eagle2_kv_cache_usage_perc",
                                      "Fraction of the paged KV cache's blocks in use (1 = all).")
        self.preemptions = metrics.Counter("eagle2_num_preemptions_total",
                                           "Requests preempted because KV blocks ran out.")
        self.prefix_queries = metrics.Counter("eagle2_prefix_cache_queries_total",
                                              "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = metrics.Counter("eagle2_prefix_cache_hits_total",
                                           "Prompt tokens whose K/V the prefix cache held.")
        self.max_depth = max_depth
        self._seen = {"fallbacks": 0, "reconnects": 0, "preemptions": 0, "prefix_queries": 0,
                      "prefix_hits": 0}
        self._lock = threading.Lock()
        self._gauges = (0, 0)
        self._lengths: Counter[int] = Counter()  # tokens per step of one sequence -> steps
        self._drafter = (0, 0)
        self._cache = (0.0, 0, 0, 0)  # usage, preemptions, prefix queries, prefix hits


    def step(self, num_running: int, num_waiting: int, new_tokens: list[int]) -> None:
        """After one decoding step: new_tokens = tokens each sequence got from it."""
        with self._lock:
            self._gauges = (num_running, num_waiting)
            self._lengths.update(new_tokens)

    def drafter(self, fallbacks: int, reconnects: int) -> None:
        """The drafter's counters (they change in its own threads), as of this step."""
        self._drafter = (fallbacks, reconnects)

    def cache(self, usage: float, preemptions: int, prefix_queries: int,
              prefix_hits: int) -> None:
        """The cache's state as of this step: the fraction of blocks in use, and the engine's
        running totals (`EngineStats`: they restart from 0 when its stats are reset)."""
        self._cache = (usage, preemptions, prefix_queries, prefix_hits)

    def flush(self) -> None:
        """Hand what the steps counted since the last flush to Ray's metrics."""
        with self._lock:
            (running, waiting), lengths, self._lengths = self._gauges, self._lengths, Counter()
        self.running.set(running)
        self.waiting.set(waiting)
        if lengths:
            self.drafts.inc(sum(lengths.values()))
            accepted = sum((n - 1) * k for n, k in lengths.items())
            if accepted:
                self.accepted.inc(accepted)
            for pos in range(min(max(lengths) - 1, self.max_depth)):
                steps = sum(k for n, k in lengths.items() if n - 1 > pos)
                self.accepted_per_pos.inc(steps, {"position": str(pos)})
            for n, k in lengths.items():  # Ray's histogram takes one observation a call
                for _ in range(k):
                    self.acceptance_length.observe(n)
        usage, preemptions, queries, hits = self._cache
        self.kv_usage.set(usage)
        for name, value, counter in (("fallbacks", self._drafter[0], self.fallbacks),
                                     ("reconnects", self._drafter[1], self.reconnects),
                                     ("preemptions", preemptions, self.preemptions),
                                     ("prefix_queries", queries, self.prefix_queries),
                                     ("prefix_hits", hits, self.prefix_hits)):
            if value > self._seen[name]:
                counter.inc(value - self._seen[name])
            self._seen[name] = value  # (lower after a reset: counted from there)
