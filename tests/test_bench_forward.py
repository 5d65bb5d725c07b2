"""`eagle2 bench-forward` and `eagle2 calibrate` end to end on the embedded model (small)."""

from __future__ import annotations

import json

from eagle2.calibration import Calibration
from eagle2.cli import main


def test_bench_forward_writes_curve_roofline_and_chart(tmp_path):
    out = tmp_path / "fw"
    rc = main(["bench-forward", "--batches", "1,2", "--nodes", "1,4", "--repeats", "1",
               "--prefix", "32", "--threads", "1", "--no-save-costs", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "forward.json").read_text())
    assert result["read_bandwidth_gb_s"] > 0 and result["weight_bytes"] > 100e6
    cells = {(c["batch"], c["nodes"]): c for c in result["cells"]}
    assert set(cells) == {(1, 1), (1, 4), (2, 1), (2, 4)}
    for c in cells.values():
        assert c["ms"] > 0 and 0 < c["roofline_fraction"] <= 1.5
        assert abs(sum(c["shares"].values()) - 1) < 0.02
    assert result["ratios"]["1"]["vs_one_token"]["1"] == 1.0
    for rows, times in result["greedy_lm_head"].items():  # where the lm_head has the FMA plan
        assert rows in {"1", "2", "4", "8"} and times["logits_argmax_ms"] > 0
        assert times["greedy_ms"] > 0
    assert (out / "forward.png").stat().st_size > 1000


def test_calibrate_fits_a_monotone_map_on_held_out_prompts(tmp_path, capsys):
    out = tmp_path / "calibration.json"
    rc = main(["calibrate", "--num-chat", "1", "--num-code", "1", "--max-tokens", "24",
               "--batch", "2", "--total-tokens", "12", "--depth", "3", "--tree-top-k", "4",
               "--bins", "6", "--threads", "1", "--out", str(out)])
    assert rc == 0
    cal = Calibration.load(out)
    assert 2 <= len(cal.rates) <= 9 and cal.num_samples > 50  # small bins merge
    assert list(cal.rates) == sorted(cal.rates) and 0 <= cal.rates[0] <= cal.rates[-1] <= 1
    report = json.loads(capsys.readouterr().out.split("wrote")[0])
    assert report["check_trees"] > 0 and report["accepted_per_tree"] >= 0
