"""The analysis behind `ssmquant analyze`: per-layer error accumulation over the decode horizon.

>>> from ssmquant.analysis import AnalyzeConfig, analyze
>>> result = analyze(AnalyzeConfig(model="nemotron-3-nano", synthetic=True, steps=512, batch=1))
>>> result.summary        # per layer x variant: error at the horizon, worst head, growth, forecasts
>>> verdicts(result.summary)  # per format x scheme: under / over the budget at the horizon, 32K, 128K
"""

from .fit import PowerFit, fit_power_law
from .run import AnalysisResult, AnalyzeConfig, AnalyzeError, analyze, build_variants, verdicts
from .sources import LayerSource, SourceError, default_model, open_source

__all__ = [
    "AnalysisResult",
    "AnalyzeConfig",
    "AnalyzeError",
    "LayerSource",
    "PowerFit",
    "SourceError",
    "analyze",
    "build_variants",
    "default_model",
    "fit_power_law",
    "open_source",
    "verdicts",
]
