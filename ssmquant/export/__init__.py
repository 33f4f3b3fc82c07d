"""Export: a calibrate recipe -> the files vLLM, TensorRT-LLM or FlashInfer take, and what they cannot take.

>>> from ssmquant.export import export
>>> result = export("recipe/", "vllm", engine_version="0.33.0", gpu="sm90")  # recipe/export-vllm/: vllm_serve.sh, ...
>>> print("\\n".join(result.report_lines()))  # the setting, each dropped setting with its measured cost

Engine facts (facts.py) carry the versions they hold for and their sources; README.md in this folder lists
them per engine.
"""

from ..engines.deployments import (
    TARGET_NAMES,
    TARGETS,
    Runtime,
    Target,
    UnknownTargetError,
    Violation,
    check_target,
    deployments,
    describe_deployments,
    engine_bytes,
    runtime,
    takeable_by_any,
    violations,
)
from ..engines.facts import FACTS, VERSIONS, EngineVersionError, Fact, Source
from .plan import Dropped, ExportError, ExportPlan, plan_export
from .run import ExportResult, default_out_dir, export
from .targets import flashinfer_kwargs, trtllm_env, trtllm_options, vllm_engine_args, vllm_flags

__all__ = [
    "FACTS",
    "VERSIONS",
    "EngineVersionError",
    "Fact",
    "Runtime",
    "Source",
    "Target",
    "Violation",
    "engine_bytes",
    "runtime",
    "TARGETS",
    "TARGET_NAMES",
    "Dropped",
    "ExportError",
    "ExportPlan",
    "ExportResult",
    "UnknownTargetError",
    "check_target",
    "deployments",
    "describe_deployments",
    "default_out_dir",
    "export",
    "flashinfer_kwargs",
    "plan_export",
    "takeable_by_any",
    "trtllm_env",
    "trtllm_options",
    "vllm_engine_args",
    "vllm_flags",
    "violations",
]
