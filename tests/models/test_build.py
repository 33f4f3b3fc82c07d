"""Random-weight checkpoints built from presets load through the normal checkpoint path."""

import json
import os

import pytest
from click.testing import CliRunner

from ssmquant.cli import main
from ssmquant.models import get_preset, load_model, ssm_layout
from ssmquant.models.build import BuildError, build_random_checkpoint, estimate_parameters, preset_config

# Small widths so that the test runs in seconds; the SSM mixer keeps the preset's structure (groups, conv).
SMALL = {
    "nemotron-h-8b": {
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 128,
        "mamba_num_heads": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    "qwen3.5-9b": {
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 128,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
}


def test_full_size_configs_have_the_published_ssm_shapes():
    cfg = preset_config(get_preset("nemotron-h-8b"))
    assert cfg["hybrid_override_pattern"] == get_preset("nemotron-h-8b").layer_pattern
    assert (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["n_groups"]) == (128, 64, 128, 8)
    q = preset_config(get_preset("qwen3.5-9b"))
    assert q["layer_types"].count("linear_attention") == 24 and q["linear_num_value_heads"] == 32
    # parameter counts of the architectures as built (meta device, no memory)
    assert 8.0e9 < estimate_parameters("nemotron-h-8b") < 8.2e9
    assert 8.8e9 < estimate_parameters("qwen3.5-9b") < 9.1e9


@pytest.mark.parametrize("name", ["nemotron-h-8b", "qwen3.5-9b"])
def test_built_checkpoint_loads_and_analyzes(name, tmp_path):
    out = tmp_path / "ckpt"
    summary = build_random_checkpoint(
        name, out, dtype="float32", num_layers=4, overrides=SMALL[name], progress=lambda m: None
    )
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "ssmquant_build.json").read_text())["parameters"] == summary["parameters"]
    loaded = load_model(str(out), device="cpu")
    layout = ssm_layout(loaded.model.config)
    assert list(layout["ssm_layers"]) == [i for i, c in enumerate(get_preset(name).layer_pattern[:4]) if c in "ML"]
    assert loaded.tokenizer("hi é\n", add_special_tokens=False)["input_ids"] == [3 + b for b in "hi é\n".encode()]
    res = CliRunner().invoke(
        main,
        [
            "analyze",
            "--model",
            str(out),
            "--steps",
            "16",
            "--batch",
            "1",
            "--formats",
            "int8",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "run"),
            "-q",
            "--no-plots",
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["data_source"]["kind"] == "checkpoint"
    assert set(report["stages"]) >= {"load_s", "capture_wait_s", "emulate_s", "tables_s"}


def test_bad_build_requests_are_refused(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(BuildError, match="is not empty"):
        build_random_checkpoint("nemotron-h-8b", tmp_path / "x")
    with pytest.raises(BuildError, match="unknown dtype 'int3'"):
        build_random_checkpoint("nemotron-h-8b", tmp_path / "y", dtype="int3")
    with pytest.raises(BuildError, match=r"num_layers must lie in \[1, 52\]"):
        preset_config(get_preset("nemotron-h-8b"), num_layers=60)


def test_build_command_takes_config_overrides(tmp_path):
    """`ssmquant build PRESET DIR --overrides JSON`: small test builds of a preset (the GPU script's CPU check); a
    value that is not a JSON object is refused in one line."""
    from click.testing import CliRunner

    from ssmquant.cli import main

    small = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "mamba_num_heads": 4, "mamba_head_dim": 8,
             "ssm_state_size": 16, "n_groups": 2}  # fmt: skip
    out = tmp_path / "ckpt"
    res = CliRunner().invoke(main, ["build", "nemotron-h-8b", str(out), "--device", "cpu", "--dtype", "float32",
                                    "--layers", "2", "--overrides", json.dumps(small)])  # fmt: skip
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in small} == small
    assert cfg["layers_block_type"] == ["linear_attention", "mlp"]  # the first 2 layers of the pattern, "M-"
    # the size announced is the one built (it was the preset's before --layers / --overrides); overridden fields
    # are recorded as such, not as the preset's; the files get the umask's modes (safetensors writes 0600)
    built = json.loads((out / "ssmquant_build.json").read_text())
    assert f"{built['parameters'] / 1e9:.2f} B parameters" in res.output.splitlines()[0]
    provenance = built["config_provenance"]
    assert provenance["overridden"] == small and not set(small) & set(provenance["from_preset"])
    mask = os.umask(0o022)
    os.umask(mask)
    assert all((p.stat().st_mode & 0o777) == 0o666 & ~mask for p in out.iterdir()), [
        oct(p.stat().st_mode) for p in out.iterdir()
    ]
    for bad in ("{hidden_size: 64}", "[1, 2]"):
        res = CliRunner().invoke(main, ["build", "nemotron-h-8b", str(tmp_path / "x"), "--overrides", bad])
        assert res.exit_code == 2 and "must be a JSON object of config fields" in res.output
    res = CliRunner().invoke(main, ["build", "nemotron-h-8b", str(out), "--device", "cpu"])
    assert res.exit_code == 1 and "is not empty" in res.output
