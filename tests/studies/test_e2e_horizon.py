"""Study 7's choices that its committed data rest on: analyze's batch where the text is short, the page's scale line."""

from __future__ import annotations

import pytest

from ssmquant.models.text import split_bounds
from studies.common.page import scale_note
from studies.e2e_horizon.study import HELDOUT, SCALES, analyze_batch


def test_analyze_takes_as_many_sequences_as_the_calibration_split_holds(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abcdefgh" * 1000)  # 8000 bytes
    start, stop = split_bounds(8000, "calibration")
    length = (stop - start) // 3  # three sequences fit, not four
    assert analyze_batch(str(text), 16, length) == 3
    assert analyze_batch(str(text), 2, length) == 2
    assert analyze_batch(str(text), 16, stop - start + 1) == 1  # check_text then refuses it, naming the numbers


def test_the_gpu_scale_analyzes_fourteen_sequences_after_the_longest_prompt_and_sixteen_otherwise():
    if not HELDOUT.is_file():
        pytest.skip("studies/tiny_models/data/heldout.txt is fetched by studies/tiny_models/get_corpus.py, not shipped")
    gpu = SCALES["gpu"]
    got = {p: analyze_batch(str(HELDOUT), gpu["sequences"], p + gpu["steps"]) for p in gpu["prompts"]}
    assert got == {0: 16, 2048: 16, 8192: 14}  # what the committed runs' provenance records (analyze_batch)
    cpu = SCALES["cpu"]
    assert {analyze_batch(str(HELDOUT), cpu["sequences"], p + cpu["steps"]) for p in cpu["prompts"]} == {8}


def test_the_scale_line_names_where_each_scale_ran():
    assert "one CUDA GPU, the fused Triton kernels" in scale_note({"gpu"})
    assert "2 CPU cores, the torch reference backend" in scale_note({"cpu"})
    both = scale_note({"cpu", "gpu"})
    assert "`cpu, gpu`" in both and "2 CPU cores" in both and "one CUDA GPU" in both


def test_a_weights_dtype_loads_the_model_once_in_it_and_float32_on_the_cpu_changes_nothing(tmp_path):
    """--dtype loads each model in that dtype for the analyze and eval runs; on the CPU, float32 is load_model's
    default, so the smoke run's tables are identical to a run without it, and the provenance names the dtype."""
    import json

    import pandas as pd

    from studies import run

    for name, extra in (("default", []), ("fp32", ["--dtype", "float32"])):
        run.main(["--scale", "smoke", "--only", "e2e_horizon", "--runs", "tiny-nemotron-p0", "--data",
                  str(tmp_path / name), *extra])  # fmt: skip
    data = [tmp_path / n / "e2e_horizon" / "data" for n in ("default", "fp32")]
    for table in ("analyze_tiny-nemotron-p0.csv", "e2e_tiny-nemotron-p0.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(data[0] / table), pd.read_csv(data[1] / table))
    prov = json.loads((data[1] / "runs" / "tiny-nemotron-p0.json").read_text())
    assert prov["data_source"]["weights_dtype"] == "float32"


def test_a_weights_dtype_is_refused_for_the_studies_it_does_not_apply_to(tmp_path):
    from studies import run

    with pytest.raises(SystemExit):
        run.main(["--scale", "smoke", "--only", "conv_vs_replay", "--dtype", "bfloat16", "--data", str(tmp_path)])
    assert not any(tmp_path.iterdir())
