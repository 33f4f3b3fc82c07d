"""On CPU tensors, transformers' hybrid mixers take their torch path, whatever kernel packages are installed.

transformers (5.x, ``transformers/integrations/hub_kernels.py``: ``use_kernel_func_from_hub_with_fallback``)
decorates the SSM functions of its modeling files (``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn``, ``mamba2_chunk_scan``, ...): when the modeling
file is imported, the decorator binds the implementation of the package it names (fla, causal_conv1d,
mamba_ssm) if that package imports, else the torch reference, for every device. flash-linear-attention
imports on a machine without a GPU (it is Python and Triton; transformers' own
``is_flash_linear_attention_available`` checks for CUDA, this decorator does not), and its Triton kernels
then fail on CPU tensors with "0 active drivers ([]). There should only be one."

transformers 5.25 routes CPU inputs to the torch reference itself (its ``_PACKAGE_SUPPORTED_DEVICES``), and logs
once per function that it "is falling back to its reference PyTorch implementation": on CPU, where those packages
cannot run, that notice is noise, and ``quiet_cpu_fallback_notices`` drops it through a logging filter on
transformers' hub-kernels logger (on a GPU it stays: there it says what to install for speed).

``use_torch_path_on_cpu(model)`` replaces each such function in the modeling modules of ``model`` by a
dispatcher: CPU tensors go to the torch reference (what transformers computes without the package),
anything else to the implementation transformers bound, so GPU runs are unchanged. Going straight to the
reference also skips transformers' "falling back ... install causal_conv1d / mamba_ssm" warnings, which
only add noise on CPU, where those packages cannot run.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys

import torch

_HUB_KERNELS_FILE = "hub_kernels.py"


def _fallback_reference(fn) -> object | None:
    """The torch reference behind a function decorated by ``use_kernel_func_from_hub_with_fallback``, or None."""
    if not callable(fn) or getattr(fn, "_ssmquant_torch_path", False) or getattr(fn, "_ssmquant_capture", False):
        return None
    chain, f = [], fn
    while hasattr(f, "__wrapped__") and len(chain) < 16:
        chain.append(f)
        f = f.__wrapped__
    decorated = any(getattr(getattr(g, "__code__", None), "co_filename", "").endswith(_HUB_KERNELS_FILE) for g in chain)
    return f if decorated and inspect.isfunction(f) else None


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def _dispatcher(bound, reference):
    params = inspect.signature(reference).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(bound)
    def dispatch(*args, **kwargs):
        t = _first_tensor(args, kwargs)
        if t is not None and t.device.type == "cpu":
            if not takes_any:  # transformers' wrapper drops the keywords its implementation does not take
                kwargs = {k: v for k, v in kwargs.items() if k in params}
            return reference(*args, **kwargs)
        return bound(*args, **kwargs)

    dispatch._ssmquant_torch_path = True
    return dispatch


_HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"
_FALLBACK_NOTICE = "is falling back to its reference PyTorch implementation"


class _CpuFallbackNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _FALLBACK_NOTICE not in record.getMessage()


def quiet_cpu_fallback_notices() -> None:
    """Drop transformers' "falling back to its reference PyTorch implementation" notices (idempotent): call it for
    models that compute on the CPU, where the kernel packages the notice recommends cannot run."""
    logger = logging.getLogger(_HUB_KERNELS_LOGGER)
    if not any(isinstance(f, _CpuFallbackNotice) for f in logger.filters):
        logger.addFilter(_CpuFallbackNotice())


def use_torch_path_on_cpu(model: torch.nn.Module) -> list[str]:
    """Make the modeling modules of ``model`` compute CPU tensors with transformers' torch references.

    Idempotent; affects every model of those modeling files in this process, on CPU tensors only.
    Returns the replaced functions as "module.function" (empty when there was nothing to replace).
    """
    replaced = []
    names = {type(m).__module__ for m in model.modules()}
    for name in sorted(n for n in names if n.startswith("transformers.models.")):
        mod = sys.modules.get(name)
        if mod is None:
            continue
        for attr, fn in list(vars(mod).items()):
            ref = _fallback_reference(fn)
            if ref is not None and ref.__module__ == mod.__name__:
                setattr(mod, attr, _dispatcher(fn, ref))
                replaced.append(f"{name}.{attr}")
    return replaced


__all__ = ["quiet_cpu_fallback_notices", "use_torch_path_on_cpu"]
