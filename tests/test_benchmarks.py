"""The benchmark runner (benchmarks/run.py): its registry, the RESULTS.md sections it replaces, the pure-Python parts
of the `sass` benchmark, and tiny real runs on the CPU."""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common, run, sass  # noqa: E402


def test_list_names_every_registered_benchmark_with_its_cpu_check():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "list"], capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    for name in ("emulation", "analyze", "nvfp4", "sass", "registers"):
        assert name in run.REGISTRY
        assert f"\n{name} " in "\n" + out
        assert f"python benchmarks/run.py {name} " in out


def test_an_unknown_benchmark_is_refused_with_the_registered_names(capsys):
    assert run.main(["nosuch"]) == 2
    assert "emulation" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(run.REGISTRY))
def test_each_benchmark_takes_the_arguments_of_its_cpu_check(name):
    bench = run.REGISTRY[name]
    module = importlib.import_module(bench.module)
    assert callable(module.run) and module.__doc__
    ap = argparse.ArgumentParser()
    module.add_arguments(ap)
    ap.parse_args(list(bench.check))


def test_a_section_is_replaced_and_everything_else_kept():
    text = (
        "# head\n\nintro\n\n<!-- results:a -->\n## A\n\nold a\n<!-- /results:a -->\n\nhand-written\n\n"
        "<!-- results:b -->\n## B\n\nold b\n<!-- /results:b -->\n\n## Lab\n\nlab notes\n"
    )
    block = common.section_block("a", "A", "`cmd`\n", "| x |\n|---|\n| 1 |")
    new = common.replace_section(text, "a", block)
    assert "old a" not in new and "| 1 |" in new and "`cmd`" in new
    assert new.replace(block, "") == text.replace(text[text.index("<!-- results:a -->") : text.index("\nhand")], "")
    assert common.section_keys(new) == ["a", "b"]
    assert new.count("<!-- /results:a -->") == 1


def test_a_missing_section_is_appended():
    text = "# head\n\n<!-- results:a -->\nx\n<!-- /results:a -->\n"
    block = common.section_block("c", "C", "h\n", "body")
    new = common.replace_section(text, "c", block)
    assert new.startswith(text) and new.endswith(block) and common.section_keys(new) == ["a", "c"]


def test_a_broken_or_doubled_section_is_an_error_and_keys_are_checked():
    with pytest.raises(ValueError, match="no <!-- /results:a -->"):
        common.replace_section("<!-- results:a -->\nx\n", "a", "y")
    with pytest.raises(ValueError, match="twice"):
        common.replace_section("<!-- results:a -->\n<!-- /results:a -->\n<!-- results:a -->\n", "a", "y")
    with pytest.raises(ValueError, match="results key"):
        common.section_block("A b", "t", "h", "b")


def test_update_results_files_each_section_under_its_key(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\n<!-- results:x-one -->\nold\n<!-- /results:x-one -->\n\n## kept by hand\n")
    result = common.Result({"x-one": common.Section("One", "table 1"), "x-two": common.Section("Two", "table 2")}, {})
    assert run.update_results(path, result, "`python benchmarks/run.py x`\n") == ["x-one", "x-two"]
    text = path.read_text()
    assert "old" not in text and "## kept by hand" in text
    assert text.index("## One") < text.index("## kept by hand") < text.index("## Two")
    assert "`python benchmarks/run.py x`" in text


def test_the_recorded_command_leaves_out_where_results_go():
    argv = ["sass", "--update-results", "--raw-dir", "/x", "--quick", "--results-file=/y", "--parts", "kda"]
    assert run.measured_argv(argv) == ["sass", "--quick", "--parts", "kda"]


# A time loop in cuobjdump's format: a write-mask byte (LDG.E.U8) tested by ISETP, whose branch skips the slot's write
# (0x50, 0x60) for a replay slot; a forward branch around a slow path (0x80, 0x90), always taken; the loop's back branch.
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.U8 R4, [R2.64] ;
        /*0020*/                   FADD R5, R5, R6 ;
        /*0030*/                   ISETP.NE.AND P0, PT, R4, RZ, PT ;
        /*0040*/              @!P0 BRA 0x70 ;
        /*0050*/                   FMUL R7, R7, R8 ;
        /*0060*/                   F2I.S8 R9, R7 ;
        /*0070*/               @P1 BRA 0xa0 ;
        /*0080*/                   MUFU.RCP R10, R11 ;
        /*0090*/                   FFMA R10, R10, R10, R10 ;
        /*00a0*/                   FADD R12, R12, R13 ;
        /*00b0*/                   BRA 0x10 ;
        /*00c0*/                   EXIT ;
"""


def test_the_step_path_takes_a_write_on_a_write_step_and_skips_slow_paths():
    ins = sass.parse_cuobjdump(LISTING)
    assert len(ins) == 13 and ins[1] == (0x10, "LDG.E.U8 R4, [R2.64]")
    writes = sass.step_path(ins, [True])
    assert writes == collections.Counter({"FADD": 2, "BRA": 2, "LDG": 1, "ISETP": 1, "FMUL": 1, "F2I": 1})
    no_write = sass.step_path(ins, [False])
    assert no_write == writes - collections.Counter({"FMUL": 1, "F2I": 1})
    with pytest.raises(RuntimeError, match="write-mask branches"):
        sass.step_path(ins, [True, True])


def test_the_cuda_loop_walks_its_common_path():
    """The longest loop, along its common path: a division's slow path (`@!P BRA` past it, or `@P BRA` over it to
    the fast path) and the fallback a warp vote guards (`@P BRA` to it, an unconditional `BRA` over it) are left out."""
    text = """
\t.text.other:
        /*0000*/                   NOP ;
\t.text.kda_emulate:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   FFMA R2, R3, R4, R2 ;
        /*0020*/              @!P2 BRA `(.L_x_2) ;
        /*0030*/                   CALL.REL.NOINC `($__internal_1_$__cuda_sm3x_div_rn_noftz_f32_slowpath) ;
.L_x_2:
        /*0040*/              @P3 BRA `(.L_x_3) ;
        /*0050*/                   MOV R3, R4 ;
        /*0060*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm20_rcp_rn_f32_slowpath) ;
        /*0070*/                   BRA `(.L_x_4) ;
.L_x_3:
        /*0080*/                   MUFU.RCP R9, R4 ;
.L_x_4:
        /*0090*/                   VOTE.ANY P0, P1 ;
        /*00a0*/               @P0 BRA `(.L_x_5) ;
        /*00b0*/                   FMUL R5, R5, R9 ;
        /*00c0*/                   BRA `(.L_x_6) ;
.L_x_5:
        /*00d0*/                   FCHK P4, R5, R9 ;
        /*00e0*/                   FADD R5, R5, R5 ;
.L_x_6:
        /*00f0*/              @P1  BRA `(.L_x_6) ;
        /*0100*/              @P5  BRA `(.L_x_0) ;
        /*0110*/                   EXIT ;
"""
    ops = sass.nvdisasm_loop(text, "kda_emulate")
    assert ops == collections.Counter({"FFMA": 1, "BRA": 6, "MUFU": 1, "VOTE": 1, "FMUL": 1})
    row = sass.count_row(ops, 2, format="nvfp4")
    assert row["format"] == "nvfp4" and row["per step"] == 10 and row["per element-step"] == 5.0
    assert sass.opcode("@!UP0 FFMA.FTZ R1, R2, R3, R4") == "FFMA"


def test_a_cpu_check_writes_its_raw_json_and_is_never_filed(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n")
    argv = ["emulation", "--device", "cpu", "--kinds", "mamba2", "--formats", "fp8_e4m3", "--steps", "3", "--batch",
            "1", "--peer-steps", "2", "--reps", "3", "--no-compile", "--raw-dir", str(tmp_path / "raw"),
            "--results-file", str(results), "--update-results"]  # fmt: skip
    assert run.main(argv) == 2  # a check of the script, not a measurement
    assert results.read_text() == "# Results\n"
    out = capsys.readouterr().out
    assert "<!-- emulation-mamba2 -->" in out and "| fp8_e4m3@replay16 |" in out
    (raw,) = (tmp_path / "raw").glob("emulation-*.json")
    doc = json.loads(raw.read_text())
    assert doc["complete"] and not doc["measurement"] and doc["failed"] is None
    assert "--update-results" not in doc["command"] and "--device cpu" in doc["command"]
    rows = doc["raw"]["rows"]["mamba2"]
    assert [r["variant"] for r in rows] == ["fp8_e4m3@conventional", "fp8_e4m3@replay16"]
    assert all(r["kernel G/s"] > 0 and r["eager G/s"] > 0 for r in rows)
    assert list(doc["sections"]) == ["emulation-mamba2"]


def test_sass_counts_a_kernel_from_its_machine_code(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "sass", "--quick", "--parts", "mamba2",
                           "--raw-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (raw,) = tmp_path.glob("sass-*.json")
    (row,) = json.loads(raw.read_text())["raw"]["mamba2"]
    assert row["launch"] == "fp8_e4m3" and row["per step"] > 500 and row["per element-step"] == round(row["per step"] / 64, 2)


def test_emulation_formats_take_modifiers_and_refuse_unknown_ones():
    from benchmarks import emulation

    assert all(emulation._format_ok(f) for f in ("nvfp4", "nvfp4:sr", "fp8_e4m3:head:sr", "int8:head"))
    assert not any(emulation._format_ok(f) for f in ("nvfp5", "nvfp4:rows4", "nvfp4:sr:sr", "bf16:sr"))
    rows = [{"variant": v} for v in ("nvfp4:sr@conventional", "nvfp4:head@conventional", "nvfp4@replay16")]
    runs = {"fp8_e4m3:sr@conventional": [2.0, 2.0, 2.0], "fp8_e4m3@conventional": [4.0] * 3,
            "fp8_e4m3@replay16": [3.0] * 3, "nvfp4:sr@conventional": [1.0] * 3, "nvfp4:head@conventional": [2.0] * 3,
            "nvfp4@replay16": [3.0] * 3}  # fmt: skip
    emulation.add_fp8_ratio(rows, runs)
    assert [(r["x fp8 of"], r["x fp8 time"]) for r in rows] == [
        ("fp8_e4m3:sr@conventional", "2.00"), ("fp8_e4m3@conventional", "2.00"), ("fp8_e4m3@replay16", "1.00")]


def test_an_eval_section_suffix_keeps_the_other_tables_and_a_bad_one_is_refused_before_the_run(monkeypatch):
    """benchmarks/eval.py --section NAME files under eval-<device>[-layer]-NAME, so a model measured in a device call
    of its own does not replace the other models' table; a suffix that is no key is refused before any model loads."""
    from benchmarks import eval as eval_bench

    def args(**kw):
        return argparse.Namespace(**dict(dict(models="tiny-qwen", modes="decode,layer", section=None, steps=256,
                                              batch=2, reps=1, variants="fp8_e4m3", device="cpu", text=None,
                                              text_split="heldout", layers=None), **kw))  # fmt: skip

    loaded = []
    monkeypatch.setattr(eval_bench, "_load", lambda name, a: loaded.append(name) or (None, name))
    fake = argparse.Namespace(variants=["fp8_e4m3"], summary={"kl_mean": __import__("pandas").Series([0.5])},
                              timing={"decode_s": 1.0, "memory_estimate_GiB": {"host": 1.25}, "forward_batch": 2,
                                      "metrics": "torch"})  # fmt: skip
    monkeypatch.setattr(eval_bench, "_evaluate", lambda loaded_model, a, mode, steps: fake)
    result = eval_bench.run(args())
    assert list(result.sections) == ["eval-cpu"]
    # the layer run's memory check is kept with the raw rates (no allocator peak off CUDA)
    assert result.raw["tiny-qwen"]["layer_memory"] == {"estimate_GiB": 1.25, "forward_batch": 2, "metrics": "torch"}
    both = eval_bench.run(args(section="nano"))
    assert list(both.sections) == ["eval-cpu-nano"] and both.sections["eval-cpu-nano"].title.endswith("(cpu, nano)")
    assert list(eval_bench.run(args(modes="layer", section="nano")).sections) == ["eval-cpu-layer-nano"]
    loaded.clear()
    with pytest.raises(SystemExit, match="letters, digits and '-' only"):
        eval_bench.run(args(section="a b"))
    assert loaded == []


def test_filing_a_raw_run_writes_its_sections_and_refuses_a_check(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n")
    doc = {"benchmark": "emulation", "command": "python benchmarks/run.py emulation --kinds kda",
           "utc": "2026-12-02T01:30:14+00:00", "complete": True, "measurement": True, "hardware": None, "failed": None,
           "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "python": "3.12.3", "cpus": 16,
                           "cpu": "x"},
           "sections": {"emulation-kda": {"title": "Emulation throughput: KDA", "body": "| a |\n|---|\n| 1 |\n"}}, "raw": {}}  # fmt: skip
    raw = tmp_path / "run.json"
    raw.write_text(json.dumps(doc))
    assert run.main(["file", str(raw), "--results-file", str(results)]) == 0
    text = results.read_text()
    assert "<!-- results:emulation-kda -->" in text and "NVIDIA H200; torch 2.11.0" in text and "2026-12-02 01:30" in text
    raw.write_text(json.dumps({**doc, "measurement": False}))
    assert run.main(["file", str(raw), "--results-file", str(results)]) == 1
