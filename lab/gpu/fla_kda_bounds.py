"""The numbers behind the bounds of tests/engines/test_engines_gpu.py::test_fla_kda_decode_matches_the_ideal_recurrence:
fla's fused recurrent KDA decode against the ideal recurrence at GLM-5.3-Flash's layer 0 shapes (the test's inputs).

    python lab/gpu/fla_kda_bounds.py        # a CUDA GPU with fla 0.6.0 (the engine bundle) on PYTHONPATH
"""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lab.engines import oracle  # noqa: E402
from ssmquant.models.synthetic import synthetic_inputs  # noqa: E402


def main() -> int:
    inp = synthetic_inputs("glm-5.3-flash", 0, batch=2, steps=128, device="cuda")
    for state in ("fp32", "bf16"):
        r = oracle.run_fla_kda(inp, oracle.FlaCase(state, steps=128, op="kda"))
        print(state, json.dumps(r["out_curves"], default=str)[:1200])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
