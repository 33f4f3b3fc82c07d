"""`export`: a recipe directory -> the files one serving engine takes, and a report of what it does not take."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from ..calibrate.recipe import RecipeError, load_recipe
from ..engines.deployments import TARGET_NAMES, UnknownTargetError, check_target
from ..engines.facts import FACTS
from ..report.outdir import OutputError, write_atomically
from .plan import ExportError, ExportPlan, plan_export, synthetic_note
from .profile import profile_check
from .targets import WRITERS, vllm_hf_patch

REPORT_NAME = "export_report.json"
SUMMARY_NAME = "EXPORT.md"


@dataclass
class ExportResult:
    """out_dir: where the files went; files: their names; plan: the setting and the dropped settings."""

    out_dir: pathlib.Path
    files: list[str]
    plan: ExportPlan
    metric: str
    profile: dict  # profile.profile_check: the recipe's engine profile against the target's
    synthetic: str | None = None  # plan.synthetic_note: the warning of a recipe measured on synthetic inputs

    def report_lines(self) -> list[str]:
        """The short terminal report: the setting, the engine-profile line, one line per dropped setting with its
        measured cost, and where the rest is (EXPORT.md: the engine's words, the facts, every note)."""
        p = self.plan
        lines = [
            *([self.synthetic] if self.synthetic else []),
            f"{p.deployment.label}: {p.setting.name} "
            f"({'the recipe global setting' if p.from_global else 'chosen for this engine'})",
            self.profile["line"],
        ]
        for d in p.dropped:
            lines.append(d.short_line(self.metric))
        rt, per_layer = p.runtime, p.engine_bytes["total"]
        lines.append(
            f"memory: {per_layer * p.num_ssm_layers:,} bytes per sequence in {p.deployment.name}'s buffers over "
            f"{p.num_ssm_layers} SSM layers ({rt.state_copies} state cop{'y' if rt.state_copies == 1 else 'ies'} per "
            f"layer: {rt.state_copies_assume})"
        )
        lines.append(
            f"{len(p.notes)} notes, the engine's constraint for each dropped setting and the facts relied on: "
            f"{self.out_dir / SUMMARY_NAME}"
        )
        return lines

    def full_lines(self) -> list[str]:
        """The whole report: each dropped setting with the engine's words and its cost per layer, then the notes."""
        p = self.plan
        lines = self.report_lines()[:2]
        for d in p.dropped:
            lines += d.lines(self.metric)
        lines += [f"note: {n}" for n in p.notes]
        return lines


def default_out_dir(recipe_dir, target: str) -> pathlib.Path:
    return pathlib.Path(recipe_dir) / f"export-{target}"


def export(
    recipe_dir,
    target: str,
    out_dir=None,
    *,
    num_speculative_tokens: int | None = None,
    force: bool = False,
    engine_version: str | None = None,
    gpu: str | int | None = None,
    speculative_method: str | None = None,
    speculative_model: str | None = None,
) -> ExportResult:
    """Write `target`'s files for the recipe in `recipe_dir` (atomically) and return what was written.

    target: "vllm" | "trtllm" | "flashinfer"; out_dir: default RECIPE_DIR/export-<target>; an existing
    non-empty out_dir, the default one included, is replaced only with ``force``; num_speculative_tokens:
    draft tokens of the deployment, checked against the buffer length; engine_version: a version the engine
    facts cover (None: the newest release read); gpu: "sm90" etc. (None: the local GPU, else sm90 with a
    note); speculative_method / speculative_model: the drafter, which vLLM and TensorRT-LLM need whenever the
    export drafts tokens (plan.SPEC_METHODS). Raises ExportError: unknown target, version or GPU (lists the accepted ones), bad recipe, or
    nothing the target can run within the budget (with the engine's constraints and the nearest runnable
    setting).
    """
    try:
        t = check_target(target)
    except UnknownTargetError as err:
        raise ExportError(str(err)) from None
    try:
        recipe = load_recipe(recipe_dir)
    except RecipeError as err:
        raise ExportError(str(err)) from None
    plan = plan_export(
        recipe, t, num_speculative_tokens=num_speculative_tokens, engine_version=engine_version, gpu=gpu,
        speculative_method=speculative_method, speculative_model=speculative_model,
    )  # fmt: skip
    files = WRITERS[t](plan, recipe)
    prof = profile_check(recipe, plan)
    dep, rt = plan.deployment, plan.runtime
    result_files = sorted(files) + [SUMMARY_NAME, REPORT_NAME]
    report = {
        "target": t,
        "engine": {
            "name": dep.name,
            "version": dep.version,
            "gpu": f"sm{dep.gpu}",
            "unreleased": None if dep.build is None else dep.build.label(t),
        },
        "runtime": {
            "backend": rt.backend,
            "replay_window": rt.window,
            "ring_rows": rt.ring_rows,
            "tokens_per_call": rt.tokens,
            "env": rt.env,
            "prefix_caching": rt.prefix_caching,
        },
        "engine_bytes_per_sequence": {
            "per_layer": plan.engine_bytes,
            "state_copies": rt.state_copies,
            "state_copies_assume": rt.state_copies_assume,
            "ssm_layers": plan.num_ssm_layers,
            "total": plan.engine_bytes["total"] * plan.num_ssm_layers,
        },
        "facts": {f: _fact_dict(FACTS[f]) for f in rt.facts},
        "recipe": str(recipe.path),
        "synthetic": synthetic_note(recipe),
        "setting": plan.setting.to_dict(),
        "from_global": plan.from_global,
        "engine_profile": prof,
        "measured": {
            "metric": recipe.metric,
            "budget": recipe.budget,
            "max_error_calibration": plan.entry.get("max_error"),
            "errors_calibration": plan.entry.get("errors"),
            "heldout": plan.heldout,
            "bytes_per_sequence": plan.entry.get("bytes_per_sequence"),
        },
        "draft_tokens": plan.draft_tokens,
        "speculation": None if plan.speculation is None else {"method": plan.speculation.method, "model": plan.speculation.model},
        "architecture": plan.architecture,
        "dropped": [d.to_dict() for d in plan.dropped],
        "notes": plan.notes,
        "files": result_files,
    }
    out = default_out_dir(recipe.path, t) if out_dir is None else pathlib.Path(out_dir)
    result = ExportResult(out, result_files, plan, recipe.metric, prof, synthetic_note(recipe))

    def fill(tmp: pathlib.Path):
        for name, text in files.items():
            (tmp / name).write_text(text)
            if name.endswith(".sh"):
                (tmp / name).chmod(0o755)
        (tmp / SUMMARY_NAME).write_text(_summary(result, recipe, files))
        (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")

    try:
        result.out_dir = write_atomically(out, force, fill, "export")
    except OutputError as err:
        raise ExportError(str(err)) from None
    return result


# What to do with each file an export writes (EXPORT.md's "Files").
FILE_USES = {
    "vllm_serve.sh": "starts the server: `MODEL=/path/to/checkpoint bash vllm_serve.sh` (further arguments go to "
    "`vllm serve`)",
    "vllm_flags.txt": "the same flags on one line, to append to a `vllm serve` command of your own",
    "vllm_engine_args.json": "the same settings as keyword arguments of `vllm.EngineArgs` / `vllm.LLM` (Python)",
    "vllm_env.sh": "`source vllm_env.sh` in the shell that starts vLLM",
    "hf_config_patch.json": "merge its keys into the checkpoint's config.json (a copy of it): the state dtype for a "
    "deployment that starts the engine without the dtype flag; with the flags above it changes nothing",
    "trtllm_llm_api_options.yaml": "`trtllm-serve MODEL --extra_llm_api_options trtllm_llm_api_options.yaml`, or "
    "`LLM(model, **yaml.safe_load(...))`",
    "trtllm_env.sh": "`source trtllm_env.sh` in the shell that starts TensorRT-LLM",
    "flashinfer_kwargs.json": "the keyword arguments of the FlashInfer call, per layer",
    "flashinfer_alloc.py": "allocates the state, scale and ring buffers the FlashInfer call takes",
    "sglang_serve.sh": "starts the server: `MODEL=/path/to/checkpoint bash sglang_serve.sh` (further arguments go to "
    "`sglang.launch_server`)",
    "sglang_flags.txt": "the same flags on one line, to append to a `python -m sglang.launch_server` command of your "
    "own",
}


def _absent_files(plan: ExportPlan, recipe, files: dict[str, str]) -> list[str]:
    """Why a file the target sometimes gets is not here."""
    out = []
    if plan.target == "vllm" and "hf_config_patch.json" not in files:
        out.append(vllm_hf_patch(plan, recipe)[1])
    if plan.target == "vllm" and "vllm_env.sh" not in files:
        out.append("no vllm_env.sh: this setting needs no environment variable")
    if plan.target == "trtllm" and "trtllm_env.sh" not in files:
        out.append(
            "no trtllm_env.sh: no environment variable is needed"
            + (" (GDN replay is opt-in: leave TRTLLM_USE_GDN_REPLAY unset)" if recipe.layer_kind == "gdn" else "")
        )
    if plan.target == "sglang":
        out.append(
            "no hf_config_patch.json and no environment file: --mamba-ssm-dtype sets SGLANG_MAMBA_SSM_DTYPE, which "
            "overrides the checkpoint's mamba_ssm_dtype for every SSM layer"
        )
    if plan.target == "trtllm" and "hf_config_patch.json" not in files:
        out.append("no hf_config_patch.json: TensorRT-LLM's mamba_ssm_cache_dtype key covers Mamba-2 and GDN, not KDA")
    return out


def _fact_dict(f) -> dict:
    return {"says": f.says, "quote": f.quote, "versions": f.range, "sources": [str(x) for x in f.sources]}


def _summary(result: ExportResult, recipe, files: dict[str, str]) -> str:
    p = result.plan
    dep, rt, b = p.deployment, p.runtime, p.engine_bytes
    name = TARGET_NAMES[p.target]
    n = p.num_ssm_layers
    synthetic = synthetic_note(recipe)
    lines = [
        f"# {name} export of {recipe.config['model'].get('name')}",
        "",
        *([f"**{synthetic}.**", ""] if synthetic else []),
        f"Checked for **{dep.label}** with {p.draft_tokens} draft tokens per step"
        + (f"; {dep.build.label(p.target)}" if dep.build is not None else "")
        + ".",
        "",
        f"Recipe: `{recipe.path}` (schema {recipe.config['schema_version']}); budget {recipe.metric} <= "
        f"{recipe.budget:g} at step {recipe.config['budget']['horizon']}.",
        "",
        f"{name} runs **{p.setting.name}** on every SSM layer: worst calibrated layer {recipe.metric} "
        f"{p.entry['max_error']:.4g}, {p.entry['bytes_per_sequence']:,} bytes per sequence over the "
        f"{len(recipe.config['model']['calibrated_layers'])} calibrated layers (ssmquant's count).",
        "",
        result.profile["line"].replace("engine profile MISMATCH", "**Engine profile MISMATCH**", 1),
        "",
        "## How the engine runs it",
        "",
        f"- kernel / backend: `{rt.backend}`",
        "- decoding: " + (f"replay, window {rt.window}, ring of {rt.ring_rows} rows" if rt.replay else "conventional")
        + f", {rt.tokens} token(s) per decode call",
    ]
    if rt.prefix_caching is False:
        lines.append("- prefix caching: off (`--no-enable-prefix-caching`)")
    lines += [f"- environment: `{k}={v}`" for k, v in rt.env.items()]
    lines += [
        "",
        f"## Bytes per sequence in {name}'s buffers",
        "",
        "| per SSM layer | state | scales | ring | slot bookkeeping | total |",
        "|---|---|---|---|---|---|",
        f"| bytes | {b['state']:,} | {b['scales']:,} | {b['ring']:,} | {b['slot']:,} | {b['total']:,} |",
        "",
        f"The state and scales count **{rt.state_copies} cop{'y' if rt.state_copies == 1 else 'ies'}** of the layer's "
        f"state per sequence, as {name} reserves them: {rt.state_copies_assume}.",
        "",
        f"Over the model's {n} SSM layers: **{b['total'] * n:,} bytes per sequence**.",
        "",
        "## Engine facts relied on",
        "",
    ]
    lines += [f"- {FACTS[f].says} {FACTS[f].cite()}" for f in rt.facts]
    lines += [
        "",
        "## Not consumed by the engine",
        "",
    ]
    if p.dropped:
        for d in p.dropped:
            out = d.lines(recipe.metric)
            lines.append(f"- {out[0]}")
            lines += [f"  {x.strip()}" for x in out[1:]]
    else:
        lines.append("Nothing: the recipe's decisions are consumed as they are.")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in p.other_notes]
    lines += ["", "## Files", ""] + [f"- `{f}`" + (f": {FILE_USES[f]}" if f in FILE_USES else "") for f in sorted(files)]
    lines += [f"- {x}" for x in _absent_files(p, recipe, files)]
    return "\n".join(lines) + "\n"
