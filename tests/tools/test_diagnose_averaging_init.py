"""ddl_lab/studies/diagnose_averaging_init.py: its --quick, the whole pipeline on bench_pretrain's quick preset."""

from __future__ import annotations

import json

import pytest

from ddl_lab.studies import diagnose_averaging_init as diagnose


@pytest.mark.slow
def test_quick_run_trains_every_case_and_the_identity_start_is_gpt2(tmp_path):
    argv = ["--quick", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path)]
    results = diagnose.main(argv)
    assert (results["preset"], results["steps"]) == ("quick", 40)
    rows = {row["case"]: row for row in results["rows"]}
    assert list(rows) == list(diagnose.CASES)
    assert all([step for step, _ in row["curve"]] == [0, 20, 40] for row in rows.values())
    start = {case: row["curve"][0][1] for case, row in rows.items()}
    # The identity convolutions compute GPT-2 (same weights, β ≡ 0) at step 0; averaging taps do not.
    assert start["identity everywhere (= GPT-2 at step 0)"] == pytest.approx(start["GPT-2 (baseline)"], abs=1e-5)
    assert abs(start["averaging everywhere"] - start["GPT-2 (baseline)"]) > 1e-3
    written = json.loads((tmp_path / "averaging_init_quick.json").read_text())
    assert written["rows"] == json.loads(json.dumps(results["rows"]))
    typed = "python -m ddl_lab.studies.diagnose_averaging_init --quick --cache-dir "
    assert written["provenance"]["command"].startswith(typed)
    report = (tmp_path / "averaging_init_quick.md").read_text()
    assert f"> Command: `{typed}" in report and "quick preset, 40 steps" in report
    assert all(f"| {case} |" in report for case in diagnose.CASES)
