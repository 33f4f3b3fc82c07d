"""What each engine version runs, per layer kind: the table of EXPORT.md, generated from the engine facts.

`support_markdown()` asks `engines.violations` about a fixed grid of settings (state dtype x decoding scheme x
rounding) at the reference layer sizes of each kind, for every engine version the facts cover, on an H100/H200
(sm90) and a B200 (sm100), and lists what runs with the facts (and so the source lines) it relies on.
Consecutive versions that run the same are one row. tests/export/test_support.py checks that the committed
EXPORT.md is this function's output; regenerate it with

    python -c "from ssmquant.export.support import support_markdown; print(support_markdown(), end='')" > EXPORT.md
"""

from __future__ import annotations

from ..calibrate.settings import Setting
from ..engines.deployments import KDA_FAMILY_NAMES, Target, runtime, violations
from ..engines.facts import ENGINE_NAMES, ENGINES, FACTS, VERSIONS
from ..kinds import LayerDims

GPUS = (90, 100)
# reference layer sizes (ARCHITECTURE.md): Nemotron-3-Nano, Qwen3.5-9B, GLM-5.3-Flash
KINDS = (
    ("mamba2", None, "Mamba-2 (NemotronH)", LayerDims("mamba2", 64, 64, 128, 8)),
    ("gdn", "Qwen3_5ForConditionalGeneration", "GDN (Qwen3.5)", LayerDims("gdn", 32, 128, 128, 16)),
    ("kda", "KimiK3ForConditionalGeneration", "KDA (Kimi-K3)", LayerDims("kda", 64, 128, 128, 64)),
    ("kda", "Glm5NextForConditionalGeneration", "KDA (GLM-5.3-Flash)", LayerDims("kda", 64, 128, 128, 64)),
    ("kda", "KimiLinearForCausalLM", "KDA (Kimi-Linear)", LayerDims("kda", 32, 128, 128, 32)),
)
DTYPES = ("fp32", "bf16", "fp16", "fp16:sr", "int8", "fp8_e4m3", "fp8_e4m3:sr")


def _schemes(engine: str, kind: str) -> tuple[tuple[str, int], ...]:
    """(scheme, draft tokens) asked about: conventional, replay without drafts, and the engine's speculative forms
    (TensorRT-LLM: a long draft, whose replay history grows past 16, and a short one, which GDN replay takes)."""
    if kind == "kda" and engine == "vllm":
        specs = (("spec5x4:fp32", 4),)
    elif engine == "trtllm":
        specs = (("spec21x20", 20), ("spec16x3", 3))
    else:
        specs = (("spec16x3", 3),)
    return (("conventional", 0), ("replay16", 0), *specs)


def _row(engine: str, version: str, kind: str, arch: str | None, dims, gpu: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    runs, facts = [], []
    for scheme, drafts in _schemes(engine, kind):
        t = Target.make(engine, version, gpu, drafts, dims, arch)
        for d in DTYPES:
            s = Setting.parse(f"{d}@{scheme}")
            if not violations(t, s, kind):
                runs.append(s.name)
                facts += [f for f in runtime(t, s, kind).facts if f not in facts]
    return tuple(runs), tuple(facts)


def support_rows(engine: str) -> list[dict]:
    """One dict per (layer kind, GPU, run of versions with the same answer): versions, kind, gpu, runs, facts."""
    rows = []
    for kind, arch, label, dims in KINDS:
        for gpu in GPUS:
            prev = None
            for v in VERSIONS[engine]:
                runs, facts = _row(engine, v, kind, arch, dims, gpu)
                if prev is not None and (prev["runs"], prev["facts"]) == (runs, facts):
                    prev["versions"].append(v)
                    continue
                prev = {"versions": [v], "kind": label, "gpu": f"sm{gpu}", "runs": runs, "facts": facts}
                rows.append(prev)
    return rows


def _versions(vs: list[str]) -> str:
    return vs[0] if len(vs) == 1 else f"{vs[0]} to {vs[-1]}"


def support_markdown() -> str:
    """EXPORT.md: per engine, for each layer kind, the state dtypes and schemes each version runs, with sources."""
    out = [
        "# What each engine runs, per layer kind",
        "",
        "Generated from `ssmquant/engines/facts.py` by `ssmquant.export.support.support_markdown()` (do not edit; "
        "tests/export/test_support.py checks it is current). For each engine version the facts cover, each layer "
        "kind at its reference sizes (Nemotron-3-Nano, Qwen3.5-9B, GLM-5.3-Flash / Kimi-K3 64 heads, Kimi-Linear "
        "32 heads) and a GPU (sm90: H100/H200, sm100: B200), the settings of this grid that the export runs:",
        "",
        f"- state: {', '.join(DTYPES)} (`:sr`: stochastic rounding);",
        "- decoding: conventional, replay16 (checkpoint + 16-token buffer, no drafts), and the engine's speculative "
        "replay (vLLM Mamba-2 / FlashInfer spec16x3; vLLM KDA RecoverSSM spec5x4 with an fp32 buffer; TensorRT-LLM "
        "spec21x20, its history max(16, 1 + 20)).",
        "",
        "Each row's sources are the facts the runnable settings rely on (engine words and paths in "
        "`ssmquant/export/README.md` and every export's EXPORT.md). `ssmquant export` says why anything else is "
        "refused. Facts marked `(not read here)` are taken from issue 26's text (TensorRT-LLM's source is not on PyPI).",
    ]
    for e in ENGINES:
        out += ["", f"## {ENGINE_NAMES[e]}", "", "| versions | layer kind | GPU | runs | sources |", "|---|---|---|---|---|"]
        for r in support_rows(e):
            runs = ", ".join(f"`{x}`" for x in r["runs"]) or "nothing"
            src = "<br>".join(f"`{f}` {FACTS[f].cite()}" for f in r["facts"]) or "-"
            out.append(f"| {_versions(r['versions'])} | {r['kind']} | {r['gpu']} | {runs} | {src} |")
    return "\n".join(out) + "\n"


__all__ = ["KDA_FAMILY_NAMES", "support_markdown", "support_rows"]
