"""Calibration: state statistics, static scales, the per-layer choice under an error budget, the recipe.

>>> from ssmquant.calibrate import CalibrateConfig, calibrate, write_recipe, load_recipe
>>> result = calibrate(CalibrateConfig(model="nemotron-3-nano", synthetic=True, budget=0.02, horizon=4096))
>>> write_recipe(result, "recipe/")          # ssm_quant_config.json + ssm_state_scales.safetensors + ...
>>> recipe = load_recipe("recipe/")          # validates the schema (version 1)

See README.md in this folder for the methods and the recipe schema.
"""

from .choose import BudgetError, best_table, choose_global, choose_layer, evaluate_layer, uniform_table
from .recipe import (
    CONFIG_NAME,
    SCALES_NAME,
    SCHEMA_VERSION,
    STATS_NAME,
    Recipe,
    RecipeError,
    build_document,
    load_recipe,
    scale_name,
    validate_document,
    write_recipe,
)
from .run import CalibrateConfig, CalibrationResult, calibrate
from .scales import calibrate_scales, decode_scale
from .settings import (
    METRICS,
    CalibrateError,
    CalibrationMethod,
    LayerDims,
    Setting,
    buffer_bytes,
    build_settings,
    parse_method,
    setting_bytes,
    state_bytes,
)
from .stats import StateStats, collect_stats, iter_reference_states
from .verify import synthetic_heldout_source, verify_layers

__all__ = [
    "CONFIG_NAME",
    "METRICS",
    "SCALES_NAME",
    "SCHEMA_VERSION",
    "STATS_NAME",
    "BudgetError",
    "CalibrateConfig",
    "CalibrateError",
    "CalibrationMethod",
    "CalibrationResult",
    "LayerDims",
    "Recipe",
    "RecipeError",
    "Setting",
    "StateStats",
    "best_table",
    "buffer_bytes",
    "build_document",
    "build_settings",
    "calibrate",
    "calibrate_scales",
    "choose_global",
    "choose_layer",
    "collect_stats",
    "decode_scale",
    "evaluate_layer",
    "iter_reference_states",
    "load_recipe",
    "parse_method",
    "scale_name",
    "setting_bytes",
    "state_bytes",
    "synthetic_heldout_source",
    "uniform_table",
    "validate_document",
    "verify_layers",
    "write_recipe",
]
