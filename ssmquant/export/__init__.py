"""Export: a calibrate recipe -> the files vLLM, TensorRT-LLM or FlashInfer take, and what they cannot take.

>>> from ssmquant.export import export
>>> result = export("recipe/", "vllm")       # recipe/export-vllm/: vllm_serve.sh, vllm_engine_args.json, ...
>>> print("\\n".join(result.report_lines()))  # the setting, each dropped setting with its measured cost

See README.md in this folder for the engine constraints.
"""

from .engines import TARGET_NAMES, TARGETS, UnknownTargetError, check_target, takeable_by_any, violations
from .plan import Dropped, ExportError, ExportPlan, plan_export
from .run import ExportResult, default_out_dir, export
from .targets import flashinfer_kwargs, trtllm_env, trtllm_options, vllm_engine_args, vllm_flags

__all__ = [
    "TARGETS",
    "TARGET_NAMES",
    "Dropped",
    "ExportError",
    "ExportPlan",
    "ExportResult",
    "UnknownTargetError",
    "check_target",
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
