"""Recipes for the FlashInfer GPU test, calibrated on the CPU and committed as fixtures.

The GPU test (`test_export_flashinfer_gpu.py`) exports these recipes and runs the exported kernel arguments
through the real FlashInfer kernels. The recipes are made here, on a CPU, because `calibrate` uses
nvidia-modelopt's calibrators, which the GPU machine does not have; the GPU test needs only the recipe's
`ssm_quant_config.json` (dynamic scales: no scale file) and ssmquant itself.

Each recipe is one setting, calibrated on layer 0 of a synthetic Nemotron-3-Nano (64 heads x head_dim 64 x
d_state 128, 8 groups: the only shape FlashInfer's 8-bit replay kernel takes) over HORIZON steps of BATCH
sequences, seed 0, torch backend. The settings are the FlashInfer modules the engine oracle compiles
(`lab.engines.oracle.default_cases`: max_window 16, one token per call, 8 heads per group), so the GPU
run builds no extra module.

Regenerate (about a minute on a CPU):

    PYTHONPATH=$PWD python -m tests.export.flashinfer_recipes
"""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "flashinfer"
MODEL, LAYER, HORIZON, BATCH, SEED = "nemotron-3-nano", 0, 128, 2, 0
# (format, scheme): the calibrated candidate and its decoding scheme
CASES = [
    ("int8", "replay16"),
    ("fp8_e4m3", "replay16"),
    ("fp8_e4m3:sr", "replay16"),
    ("bf16", "replay16"),
    ("bf16", "conventional"),
    ("fp16:sr", "conventional"),
]


def case_name(fmt: str, scheme: str) -> str:
    return f"{fmt.replace(':', '-')}_{scheme}"


def config(fmt: str, scheme: str):
    """The CalibrateConfig of one fixture recipe."""
    from ssmquant.calibrate import CalibrateConfig

    kind, buf = ("conventional", []) if scheme == "conventional" else ("replay", [int(scheme.removeprefix("replay"))])
    return CalibrateConfig(
        model=MODEL,
        synthetic=True,
        budget=1.0,
        horizon=HORIZON,
        batch=BATCH,
        candidates=[fmt],
        schemes=[kind],
        buffer_lens=buf or [16],
        calibration=["none"],
        engine_fallbacks=[],
        layers=[LAYER],
        device="cpu",
        backend="torch",
        seed=SEED,
        verify=False,
    )


def make(fmt: str, scheme: str) -> dict:
    """Calibrate one case and return its recipe document (ssm_quant_config.json)."""
    from ssmquant.calibrate import CONFIG_NAME, calibrate, write_recipe

    result = calibrate(config(fmt, scheme))
    with tempfile.TemporaryDirectory() as tmp:
        rec = write_recipe(result, pathlib.Path(tmp) / "recipe")
        return json.loads((rec / CONFIG_NAME).read_text())


def fixture_dir(fmt: str, scheme: str) -> pathlib.Path:
    return FIXTURES / case_name(fmt, scheme)


def main() -> None:
    from ssmquant.calibrate import CONFIG_NAME

    shutil.rmtree(FIXTURES, ignore_errors=True)
    for fmt, scheme in CASES:
        doc = make(fmt, scheme)
        d = fixture_dir(fmt, scheme)
        d.mkdir(parents=True)
        (d / CONFIG_NAME).write_text(json.dumps(doc, indent=2) + "\n")
        layer = doc["layers"][0]
        print(f"{d.name}: {doc['budget']['metric']} {layer['calibration_error'][doc['budget']['metric']]:.4g}", flush=True)


if __name__ == "__main__":
    main()
