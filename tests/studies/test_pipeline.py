"""The smallest end-to-end run of every study (`SCALE=smoke`): simulations -> summary tables -> pages.

It runs the same code as the committed pages at a few dozen steps, so a change that breaks a study's
collection or its page fails here. The modelopt import of the calibration study dominates its time."""

from __future__ import annotations

import pandas as pd
import pytest

from studies import make_pages, run


@pytest.mark.slow
def test_smoke_pipeline_builds_every_page(tmp_path):
    timings = run.main(["--scale", "smoke", "--data", str(tmp_path)])
    assert timings, "no run was made"
    answers = make_pages.main(["--data", str(tmp_path)])
    assert [a["folder"] for a in answers] == list(run.STUDIES)
    for a in answers:
        page = (tmp_path / a["folder"] / "README.md").read_text()
        assert "Scale of this page: `smoke`" in page and "Superseded figures" in page, a["folder"]
        assert "## Reproduce" in page and a["answer"] and a["answer"] != "no data", a["folder"]
    index = (tmp_path / "README.md").read_text()
    assert all(f"]({s}/README.md)" in index for s in run.STUDIES)
    head = pd.read_csv(tmp_path / "conv_vs_replay" / "headline.csv")
    assert {"tiny-nemotron", "tiny-qwen", "nemotron-3-nano"} <= set(head["model"])
    assert (head["ratio_all_steps_lo"] <= head["ratio_all_steps"]).all()
    allv = pd.read_csv(tmp_path / "conv_vs_replay" / "all_variants.csv")
    assert {"state_err_all_median", "state_err_horizon_median", "out_err_all_median_lo"} <= set(allv.columns)
    profiles = (tmp_path / "synthetic_profiles" / "README.md").read_text()
    assert "persistent" in profiles and "stress profile" in profiles
    cal = pd.read_csv(tmp_path / "granularity_calibration" / "calibration.csv")
    assert {"heldout err", "heldout vs dynamic lo", "calibration vs dynamic"} <= set(cal.columns)
