"""The GPU test's driving loop, proven on the CPU: the committed recipes, exported for FlashInfer, decoded through
the exported arguments with FlashInfer's kernels re-computed in torch (`ssmquant.engines.flashinfer`, which
`tests/engines` prove equal to the `flashinfer` engine profile call by call).

Since the stand-in computes what the profile computes, the re-measured errors must equal the profile's up to
where the two measure differently: the state at a flush step (the profile rounds the checkpoint at the L-th
token, the kernel in the next call), and the output dtype (the kernel returns bf16). This is what the GPU
test's 25% bound is set against. Also: the committed recipes are what calibrate makes today.
"""

import json
import math
import runpy
import shutil

import pytest

from ssmquant.calibrate import CONFIG_NAME, load_recipe
from ssmquant.calibrate.settings import METRICS
from ssmquant.export import export

from .flashinfer_recipes import CASES, case_name, fixture_dir, make
from .flashinfer_run import RecomputedKernels, measure

SLOTS, CACHE = [1, 3], 4
# the cases whose stand-in is exact: fp16 stochastic rounding under replay is not re-computed (not a case here)
RUN_CASES = [("int8", "replay16"), ("fp8_e4m3:sr", "replay16"), ("bf16", "replay16"), ("fp16:sr", "conventional")]


def _exported(tmp_path, fmt, scheme):
    rec = tmp_path / "recipe"
    rec.mkdir()
    shutil.copy(fixture_dir(fmt, scheme) / CONFIG_NAME, rec / CONFIG_NAME)
    res = export(rec, "flashinfer", gpu="sm90")
    mp = pytest.MonkeyPatch()
    mp.setenv("SSMQUANT_DEVICE", "cpu")
    mp.setenv("SSMQUANT_CACHE", str(CACHE))
    ns = runpy.run_path(str(res.out_dir / "flashinfer_alloc.py"))
    mp.undo()
    return res, ns


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "scheme"), RUN_CASES, ids=[case_name(*c) for c in RUN_CASES])
def test_exported_arguments_reproduce_the_profile(tmp_path, fmt, scheme):
    res, ns = _exported(tmp_path, fmt, scheme)
    fn = getattr(RecomputedKernels(), ns["FUNCTION"].rsplit(".", 1)[1])
    row = measure(fn, ns, load_recipe(res.out_dir.parent), SLOTS)
    print(json.dumps(row))
    recipe, here, profile, kernel = (
        row[k] for k in ("recipe_emulation", "emulation_here", "flashinfer_profile", "kernel_through_export")
    )
    for m in METRICS:  # same machine, same torch: the recipe's numbers come back
        assert math.isclose(here[m], recipe[m], rel_tol=1e-6), (m, here[m], recipe[m])
    k, p = kernel["state_rel_err"], profile["state_rel_err"]
    assert abs(k - p) <= 0.1 * p, f"state: stand-in {k:.4g} vs profile {p:.4g}"
    k, p = kernel["out_rel_err"], math.hypot(profile["out_rel_err"], row["bf16_output_floor"])
    assert abs(k - p) <= 0.1 * p, f"output: stand-in {k:.4g} vs hypot(profile, bf16 floor) {p:.4g}"
    untouched = [i for i in range(CACHE) if i not in SLOTS]
    assert (ns["state"][untouched].float() == 0).all()


@pytest.mark.slow
def test_committed_recipes_are_what_calibrate_makes():
    """One fixture re-made (the others share the code path): its errors equal the committed ones to 1e-4 relative.

    The errors are FP32 sums whose order torch may change between releases (a few ulps, 1e-7 relative), which the
    tolerance absorbs; a change of the emulation moves them by far more. A change the project makes on purpose
    regenerates the fixtures: `PYTHONPATH=$PWD python -m tests.export.flashinfer_recipes`."""
    fmt, scheme = CASES[0]
    doc = make(fmt, scheme)
    committed = json.loads((fixture_dir(fmt, scheme) / CONFIG_NAME).read_text())
    assert doc["layers"][0]["setting"] == committed["layers"][0]["setting"]
    regenerate = "if the change is meant: PYTHONPATH=$PWD python -m tests.export.flashinfer_recipes"
    for m in METRICS:
        a, b = doc["layers"][0]["calibration_error"][m], committed["layers"][0]["calibration_error"][m]
        assert math.isclose(a, b, rel_tol=1e-4), (m, a, b, regenerate)
