"""End-to-end evaluation: what a stored SSM state does to a model's predictions.

>>> from ssmquant.evaluate import EvalConfig, evaluate, write_eval
>>> result = evaluate(EvalConfig("tiny-nemotron", ["fp8_e4m3@conventional", "nvfp4@replay16"], steps=512, batch=4))
>>> result.summary      # per variant: KL (nats), top-1 agreement, change in loss, overall and at the horizon
>>> write_eval(result, "out/e2e")   # positions.parquet, summary.csv, eval.json, kl.png

Teacher-forced token-by-token decoding over held-out text with transformers' own cache: after every
decode step, each SSM layer's cached recurrent state is replaced by its stored (fake-quantised) value
where the variant's scheme writes. See README.md for what is and is not emulated.
"""

from .decode import TeacherForced
from .files import load_eval, write_eval
from .metrics import METRICS, compare_step, reference_step
from .run import (
    DEFAULT_HORIZON_FRACTION,
    EvalConfig,
    EvalResult,
    EvalSettings,
    evaluate,
    parse_eval_variants,
    summary_text,
    variant_grid,
)
from .states import EvalError, SSMLayer, StateWriter, layer_seed, ssm_layers

__all__ = [
    "DEFAULT_HORIZON_FRACTION",
    "METRICS",
    "EvalConfig",
    "EvalSettings",
    "EvalError",
    "EvalResult",
    "SSMLayer",
    "StateWriter",
    "TeacherForced",
    "compare_step",
    "evaluate",
    "layer_seed",
    "load_eval",
    "parse_eval_variants",
    "reference_step",
    "ssm_layers",
    "summary_text",
    "variant_grid",
    "write_eval",
]
