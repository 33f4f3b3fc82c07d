"""Which engine profile an export target runs its setting with, against the profile the recipe measured with.

`ssmquant calibrate --engine X` emulates every candidate with profile X's arithmetic and records it in the
recipe (`engine_profile`; recipes made before that field existed were measured with `ideal`). The target
runs the exported setting through one kernel; the profile that emulates that kernel is

| target, how it runs the setting (`Runtime.backend`) | profile |
|---|---|
| FlashInfer (any kernel function) | `flashinfer` |
| vLLM, `--mamba-backend flashinfer` (ReplaySSM, or fp16 stochastic rounding off SM 10.x) | `flashinfer` |
| vLLM, Triton backend | `vllm` |
| TensorRT-LLM, Mamba-2 on FlashInfer's kernels (head_dim 64 / 128, 1 / 8 / 16 heads per group: `trtllm.fi_ssu`) | `flashinfer` |
| TensorRT-LLM, its Triton kernel (other sizes) | `trtllm` |
| SGLang (Mamba-2 on `--mamba-backend flashinfer`: FlashInfer's arithmetic; GDN / KDA on its Triton decode: fla's fused recurrent arithmetic, the ideal recurrence) | `sglang` |

and the profile must take the setting on the recipe's layer (`ssmquant.engines.profiles.check_variant`);
where it refuses (e.g. vLLM's Triton ReplaySSM, TensorRT-LLM's MTP replay, FlashInfer's GDN decode are not
modelled), no profile emulates the target's kernel and the export says so with the profile's reason.
"""

from __future__ import annotations

from ..engines.profiles import IDEAL, EngineError, arithmetic, check_variant


def target_profile(plan, layer_kind: str, state_shape: tuple[int, ...]) -> tuple[str | None, str]:
    """(profile, reason): the profile emulating how `plan`'s target runs its setting, or (None, the
    profile's refusal) when none does. state_shape: (heads, rows, state_dim) of the recipe's layers."""
    if plan.target == "flashinfer" or (
        plan.target in ("vllm", "trtllm") and plan.runtime.backend.startswith("flashinfer")
    ):
        name = "flashinfer"
    else:
        name = plan.target  # vllm (Triton backend), trtllm or sglang
    s = plan.setting
    try:
        check_variant(name, s.format, s.scheme, layer_kind, tuple(state_shape))
    except EngineError as err:
        return None, str(err)
    return name, ""


def profile_check(recipe, plan) -> dict:
    """The export report's `engine_profile` block and its one line (`line`).

    measured: the recipe's profile; recorded: False for a recipe without the field (treated as `ideal`);
    target: the profile of the target's kernel (None: not modelled; `reason` says why); matches: the
    recipe's numbers were measured with that profile; same_arithmetic: the two profiles compute this layer
    kind alike (`profiles.arithmetic`), so the numbers carry over although the names differ; remeasure: the
    command that measures the recipe with the target's profile (None when it matches or none exists).
    """
    measured = recipe.engine_profile
    recorded = measured is not None
    measured = measured or IDEAL
    kind = recipe.layer_kind
    d = recipe.dims
    target, reason = target_profile(plan, kind, (d.heads, d.rows, d.state_dim))
    matches = target == measured
    same = target is not None and arithmetic(target, kind) == arithmetic(measured, kind)
    cfg = recipe.config
    remeasure = None
    if target is not None and not matches:
        # the exported setting as the only candidate: the target's profile runs it (checked above), where the
        # default candidates may hold none it runs (vLLM's Triton profile stores no 8-bit state)
        fmt, scheme = plan.setting.format, plan.setting.scheme
        remeasure = (
            f"ssmquant calibrate --engine {target} --model {cfg['model'].get('name')} --budget "
            f"{recipe.budget:g} --metric {recipe.metric} --horizon {cfg['budget']['horizon']}"
            + (f" --prompt {cfg['budget']['prompt']}" if cfg["budget"].get("prompt") else "")
            + (f" --prompt-store {plan.setting.prompt_store}" if plan.setting.prompt_store else "")
            + f" --candidates {fmt.name} --schemes {scheme.name} --out RECIPE_DIR"
        )
    src = (
        ""
        if recorded
        else " (the recipe records no engine_profile: made before `calibrate --engine`, treated as ideal)"
    )
    how = f"{plan.setting.name} on {plan.deployment.label if plan.deployment else plan.target}"
    if target is None:
        line = f"engine profile: measured with `{measured}`{src}; no profile emulates {how}: {reason}"
    elif matches:
        line = f"engine profile: measured with `{measured}`{src}, the profile of {how}"
    else:
        line = (
            f"engine profile MISMATCH: measured with `{measured}`{src}, but {how} computes as the `{target}` "
            + ("profile (the same arithmetic on this layer kind, other constraints)" if same else "profile")
            + f"; re-measure: `{remeasure}`"
        )
    return {
        "measured": measured,
        "recorded": recorded,
        "target": target,
        "reason": reason or None,
        "matches": matches,
        "same_arithmetic": same,
        "remeasure": remeasure,
        "line": line,
    }
