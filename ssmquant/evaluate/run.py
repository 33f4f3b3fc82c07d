"""`evaluate`: decode a model over held-out text with every SSM layer's state stored in each variant, and
measure how its predictions drift from the FP32-state model.

The FP32-state reference and every variant decode the same sequences, on a GPU folded into one batch (``loop``:
one forward per decode step for all of them; passes of fewer variants when memory is short), on the CPU each in
its own forward (``fold`` of ``evaluate`` chooses);
a variant's slice differs from the reference's only in that, after each forward, its SSM states are
replaced by their stored (fake-quantised) values where the variant's scheme writes
(``states.StateWriter``). Only the current step's log-probs are held (no [B, T, vocab] tensor).

What this emulates. Conventional decoding: the state is rounded after every step, and the next step
starts from the rounded state. Replay(L) and speculative replay: the cache holds the exact (unrounded)
state between flushes, i.e. the FP32 checkpoint-plus-buffer state, and it is rounded only at the
scheme's flush steps, which is replay's checkpoint rounding. Not emulated end to end: the rounding of
the buffered inputs to the buffer dtype (bf16 by default) that replay engines apply; the per-layer
``ssmquant analyze`` emulates it. Also untouched: the conv states and the attention layers' KV cache.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import pandas as pd
import torch

from .. import __version__
from ..analysis.devices import torch_threads
from ..analysis.run import AnalyzeConfig, AnalyzeError, build_variants, first_write_step
from ..formats import FormatError, ScaleMode, StateFormat, parse
from ..models import (
    ByteTokenizer,
    LoadedModel,
    ModelLoadError,
    TextError,
    attention_dims,
    attention_layers,
    load_model,
    ssm_layout,
)
from ..models.mixers import find_ssm_mixers
from ..models.scan_substitution import can_skip_scans
from ..models.text import calibration_batch, load_text, split_bounds, text_origin, text_phrase
from ..provenance import environment
from ..replay.schemes import DEFAULT_BUFFER_LEN
from ..replay.variants import Variant, VariantError, check_variants_fit, parse_variant, parse_variants
from ..sizing import (
    FP32,
    SizingError,
    check_memory,
    eval_memory,
    format_bytes,
    free_bytes,
    layer_major_memory,
    layout_dims,
    peak_label,
    prefill_bytes_per_token,
    prefill_layer_peak,
)
from .decode import attention_refusal, decode_attention
from .graphs import SegmentGraphs, backend_for, graph_refusal
from .layer_major import fused_metrics_default, layer_major_pass
from .loop import CHECK_EVERY, CPU_ROW_MULTIPLE, Clock, decode_pass, plan_passes, run_steps, total_steps
from .metrics import LN2, horizon_window, positions_frame, sequences_frame, summary_rows
from .states import WRITE_BYTES_PER_ELEMENT, WRITE_GROUP_ELEMENTS, EvalError, StateWriter, ssm_layers

DEFAULT_HORIZON_FRACTION = 0.1
# On CPU, models below this many parameters decode with one thread: their per-step ops are so small that
# thread hand-offs dominate (x100 on a loaded 2-core host). Results do not depend on it.
SMALL_MODEL_PARAMS = 100_000_000


@dataclass
class EvalSettings:
    """The settings an evaluation ran with, resolved (eval.json's "settings": the model and device as loaded, the
    variants by name, fold and passes as chosen)."""

    model: str
    variants: list[str]
    steps: int
    batch: int
    seed: int = 0
    prompt: int = 0
    device: str = "auto"
    text: str | None = None
    text_split: str = "heldout"
    horizon_fraction: float = DEFAULT_HORIZON_FRACTION
    threads: int | None = None
    fold: bool = True
    variants_per_pass: int | None = None
    cuda_graphs: bool = False
    kv_buffer: bool = False
    cudnn_attention: bool = False
    mode: str = "decode"


@dataclass
class EvalResult:
    """Tables of an evaluation.

    positions: one row per (variant, position): kl (nats), top1_agree, delta_loss (``loss_unit``), means over
    the batch. summary: one row per variant (means overall and over the horizon window, write counts).
    sequences: one row per (variant, sequence of the batch): the summary's means for that sequence alone.
    reference: the FP32-state model's own loss (mean and at the horizon) in ``loss_unit``.
    """

    config: EvalSettings
    source: dict
    variants: list[Variant]
    positions: pd.DataFrame
    summary: pd.DataFrame
    reference: dict
    environment: dict
    sequences: pd.DataFrame | None = None
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    timing: dict = field(default_factory=dict)

    @property
    def loss_unit(self) -> str:
        return self.reference["loss_unit"]

    def report(self) -> dict:
        """The eval.json document."""
        return {
            "ssmquant_version": __version__,
            "kind": "end-to-end evaluation",
            "model": self.source.get("model"),
            "data_source": self.source,
            "settings": asdict(self.config),
            "environment": self.environment,
            "elapsed_s": round(self.elapsed_s, 3),
            "timing": self.timing,
            "metrics": {
                "kl": "KL(p_fp32 || p_variant) of the next-token distributions, nats",
                "top1_agree": "fraction of sequences whose argmax equals the FP32-state model's",
                "delta_loss": f"cross-entropy of the actual next token, variant minus FP32 state, {self.loss_unit}",
                "horizon": f"mean over the last {self.reference['horizon_window']} positions "
                f"({self.reference['horizon_from']}..{self.config.steps}) and all sequences",
                "mean": "mean over all positions and sequences",
            },
            "emulation": {
                "rounded": "every SSM layer's cached recurrent state, after the steps where the scheme writes "
                "(conventional: every step; replay(L): every L-th; spec: the speculative flush schedule)",
                "between_writes": "the exact FP32 state (replay: checkpoint + buffer, unrounded)",
                "not_emulated": "the rounding of replay's buffered inputs to the buffer dtype (the per-layer "
                "`ssmquant analyze` emulates it)",
                "untouched": "conv states and the attention layers' KV cache",
                "stochastic_rounding": "stream = decode step (0-based; the prompt's state: 2^32 - 1), seed = the variant's "
                "seed mixed with the decoder-layer index",
                "prompt": "no prompt: decoding starts from an empty state" if not self.config.prompt else
                f"the first {self.config.prompt} tokens are prefilled in one forward (FP32 states); each variant then "
                "stores every SSM state once in its format (replay: its first checkpoint) and positions count the "
                "decode steps after the prompt",
            },
            "reference": self.reference,
            "summary": _records(self.summary),
            "notes": self.notes,
        }


def _records(df: pd.DataFrame) -> list[dict]:
    return [
        {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
        for rec in df.to_dict(orient="records")
    ]


# -- variants --------------------------------------------------------------------------------------------


def variant_grid(
    formats: list[str],
    schemes: list[str],
    rounding: list[str] | None = None,
    buffer_len: int = 16,
    seed: int = 0,
) -> list[Variant]:
    """formats x roundings x schemes as Variants, exactly as ``ssmquant analyze`` builds them."""
    cfg = AnalyzeConfig(
        formats=list(formats),
        schemes=list(schemes),
        rounding=list(rounding or ["rne"]),
        buffer_len=buffer_len,
        seed=seed,
    )
    try:
        return build_variants(cfg)
    except AnalyzeError as err:
        raise EvalError(str(err)) from None


def parse_eval_variants(variants, *, seed: int = 0, buffer_len: int = DEFAULT_BUFFER_LEN) -> list[Variant]:
    """Variants from "fmt@scheme" strings (a list or one comma-separated string) or Variants.

    A bare "replay" takes ``buffer_len``; string variants get the stochastic-rounding ``seed``. Names must
    be unique; static-scale formats are refused (their scales are per layer, which one Variant cannot carry).
    """
    if isinstance(variants, (str, Variant)):
        variants = variants.split(",") if isinstance(variants, str) else [variants]
    for v in variants:
        fmt = v.format if isinstance(v, Variant) else _format_or_none(v)
        if fmt is not None and fmt.scale_mode is ScaleMode.STATIC:
            name = v.name if isinstance(v, Variant) else str(v).strip()
            raise EvalError(
                f"variant {name!r} uses static scales: they are calibrated per layer, which one variant cannot "
                "carry; evaluate dynamic-scale formats (drop ':static')"
            )
    try:
        parsed = [
            parse_variant(v.strip() if isinstance(v, str) else v, seed=seed, default_buffer_len=buffer_len)
            for v in variants
        ]
        out = parse_variants(parsed)
    except VariantError as err:
        raise EvalError(str(err)) from None
    return out


def _format_or_none(spec) -> StateFormat | None:
    """The format part of a "fmt@scheme" string, or None when it does not parse (parse_variant says why)."""
    try:
        return parse(str(spec).partition("@")[0])
    except FormatError:
        return None


# -- the run ---------------------------------------------------------------------------------------------


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EvalError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _resolve_device(device) -> torch.device | None:
    """None for 'auto' (load_model's policy: GPU(s) when present, else CPU), else the torch.device."""
    if device is None or str(device) == "auto":
        return None
    d = str(device)
    if d not in ("cpu", "cuda") and not d.startswith("cuda:"):
        raise EvalError(f"unknown device {d!r}; accepted: auto, cpu, cuda, cuda:N")
    if d.startswith("cuda") and not torch.cuda.is_available():
        raise EvalError(f"device {d!r} was requested but no CUDA GPU is available; use cpu or auto")
    return torch.device(d)


def _source(loaded: LoadedModel, text_path, seed: int, batch: int, length: int, split: str = "heldout") -> dict:
    shipped = loaded.source.kind == "shipped"
    text_name = "the shipped corpus" if text_path is None else text_phrase(text_path)
    heldout = f"whole of {text_name}" if split == "all" else f"held-out split of {text_name}"
    return {
        "kind": "shipped" if shipped else "checkpoint",
        "model": loaded.source.name,
        "location": loaded.source.location,
        "architecture": loaded.arch.architecture,
        "layer_kind": loaded.arch.layer_kind,
        "weights_dtype": str(loaded.dtype).replace("torch.", ""),
        "text": {
            "origin": text_origin(text_path),
            "split": split,
            "seed": seed,
            "batch": batch,
            "length": length,
        },
        "note": f"a tiny hybrid model trained for ssmquant (real trained weights), decoded over the {heldout}"
        if shipped
        else f"a checkpoint decoded token by token over the {heldout}",
    }


def _eval_text(text_path, steps: int, batch: int, split: str = "heldout") -> str:
    """The text, checked before any model loads: its ``split`` ("heldout" or "all") must hold ``batch`` x
    (steps + 1) bytes (steps: the prompt's tokens and the decode steps).

    A token covers at least one byte, so too few bytes means too few tokens for any tokenizer; the exact
    check on tokens follows in ``select_sequences``.
    """
    if split not in EVAL_SPLITS:
        raise EvalError(f"unknown text split {split!r}; accepted: {', '.join(EVAL_SPLITS)}")
    try:
        text = load_text(text_path)
    except TextError as err:
        raise EvalError(str(err)) from None
    start, stop = split_bounds(len(text.encode("utf-8")), split)
    if (stop - start) // (steps + 1) < batch:
        where = "the text" if split == "all" else "the held-out split of the text"
        raise EvalError(
            f"{steps} steps need {batch} sequences of {steps + 1} tokens (the last token is only a target), "
            f"but {where} has only {stop - start} bytes: use fewer steps or sequences, or a "
            "longer text (--text)" + ("" if split == "all" else ", or --text-split all for a text the model never saw")
        )
    return text


@dataclass
class EvalConfig:
    """Settings of one evaluation (the `ssmquant eval` options; `evaluate` says what each does).

    model: a shipped model name, checkpoint directory, hub id or preset, or a loaded ``LoadedModel``; variants:
    "fmt@scheme" strings (a list or one comma-separated string) or Variants (dynamic scales only)."""

    model: str | LoadedModel = "tiny-nemotron"
    variants: list | str = field(default_factory=lambda: ["fp8_e4m3", "int8", "nvfp4"])
    steps: int = 256  # decode steps (after the prompt)
    batch: int = 4
    seed: int = 0
    device: str = "auto"
    text: str | None = None  # text file whose held-out split is decoded (None: the shipped corpus)
    # "heldout": the text's last HELDOUT_FRACTION (never calibrated on); "all": the whole text, for a text the model
    # never saw (the tiny models' held-out documents, studies/tiny_models/CORPUS.md)
    text_split: str = "heldout"
    # tokens prefilled before decoding: one forward of the model (its chunked path, FP32 state), after which every
    # variant stores each SSM state once in its format (stream 2^32 - 1); metrics count the decode steps after it
    prompt: int = 0
    horizon_fraction: float = DEFAULT_HORIZON_FRACTION
    threads: int | None = None
    fold: bool | None = None
    fold_width: int | None = None
    cuda_graphs: bool | None = None
    kv_buffer: bool = False
    cudnn_attention: bool = False
    # "decode": token by token through the model's cache; "layer": each variant's whole sequence in one forward, its
    # SSM recurrences replaced by the emulation's outputs (``layer_major``); None: layer on a GPU, decode on a CPU
    mode: str | None = None


EVAL_MODES = ("decode", "layer")
EVAL_SPLITS = ("heldout", "all")
RECURRENCE_NAMES = {"triton": "fused kernels (output mode)", "torch": "torch reference"}


def default_mode(device, decode_options: bool = False) -> str:
    """The evaluation mode when none is asked for: "layer" on a GPU (the fused kernels' output mode runs the
    recurrences), "decode" on a CPU (the token-by-token oracle, affordable at the small runs a CPU takes) or where
    the decode mode's own options are asked for (``decode_options``: fold, CUDA graphs or the KV buffer)."""
    on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"  # None: auto
    return "layer" if on_gpu and not decode_options else "decode"


def evaluate(
    cfg: EvalConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    notify: Callable[[str], None] | None = None,
) -> EvalResult:
    """Teacher-forced decoding of ``batch`` held-out sequences for ``steps`` tokens, FP32 state vs each variant.

    model: a shipped model name, checkpoint directory, hub id or preset (``models.load_model``), or an
    already loaded ``LoadedModel`` (then ``device`` is ignored). variants: "fmt@scheme" strings (a list or
    one comma-separated string) or Variants (dynamic scales only). Sequences of ``steps + 1`` tokens are
    drawn from the held-out split of the text (``text`` or the shipped corpus; ``text_split="all"``: the whole
    text) with ``seed``; the last
    token is only a target. ``seed`` also seeds stochastic rounding of string variants. ``threads``: CPU
    threads for the decode loop (default: 1 for models under 100M parameters, else torch's setting).

    ``fold=True``: the reference and the variants are decoded as one batch of (1 + variants) x ``batch``
    sequences, one forward per decode step (``loop``), in passes of at most ``fold_width`` variants (default: as
    many as the memory estimate allows; a note says when it takes more than one pass); ``fold=False`` decodes
    each in its own forward of ``batch`` sequences; None (the default): folded where the model sits on a GPU (its
    decode step is bound by launches, so one forward of 4 x 8 sequences costs about what one of 8 does), unfolded
    on the CPU (compute-bound: no gain, and folded CPU batches are padded to 16 rows). The two compute the same
    function; where the model's GEMMs pick their blocking by the number of rows (torch's CPU and GPU GEMMs), their
    logits differ in the last bits, and a stored state that rounds the other way turns that into a visible
    difference per position, of the size a different GEMM kernel gives (README.md, "Bits";
    tests/evaluate/test_fold.py).

    ``cuda_graphs``: replay the decode step's runs of Mamba-2 and MLP blocks as CUDA graphs (``graphs``: the
    same kernels on the same addresses, so the same results; NemotronH on one GPU); None (the default) wherever
    ``graphs.graph_refusal`` allows it, True: required (EvalError saying why not), False: never.
    ``kv_buffer``: the attention layers' KV caches are allocated once for all steps instead of growing by
    concatenation every step (``decode.KVBuffer``; the same values, bit-identical logits on the CPU and, under
    flash attention, on a GPU). Off by default: no measurable gain at 256 steps on a GPU (benchmarks/RESULTS.md);
    with cuDNN's attention it was slower and not bit-identical (a cuDNN plan per KV length and stride, see below).
    ``cudnn_attention``: on a GPU, let torch choose the decode's attention kernel (cuDNN's first on an H100 /
    H200) instead of the default, torch's choice without cuDNN (flash attention at the shapes measured;
    ``decode.decode_attention``). cuDNN builds a plan for every new KV length, which made the first run of a
    process 1.8x slower, and its results were not bit-identical from run to run; the default's are. No effect on
    the CPU.
    ``progress(done, total)`` is called after every decode step, counting sequence batches decoded (total =
    (1 + variants) x steps in one pass); ``notify(line)`` receives a time estimate measured on the first decode
    steps and, on long runs, the rate and time left every 30 s.

    Raises EvalError naming the problem (bad variant, too little held-out text for ``steps``, unknown
    device, a model whose cache holds no SSM state, a run whose memory estimate exceeds the free memory...).
    """
    t0 = time.time()
    model, variants, seed, device, text_path = cfg.model, cfg.variants, cfg.seed, cfg.device, cfg.text
    horizon_fraction, threads, fold, fold_width = cfg.horizon_fraction, cfg.threads, cfg.fold, cfg.fold_width
    cuda_graphs, kv_buffer, cudnn_attention = cfg.cuda_graphs, cfg.kv_buffer, cfg.cudnn_attention
    loaded = model if isinstance(model, LoadedModel) else None
    dev = loaded.device if loaded is not None else _resolve_device(device)
    mode = default_mode(dev, bool(cuda_graphs or fold or kv_buffer)) if cfg.mode is None else cfg.mode
    if mode not in EVAL_MODES:
        raise EvalError(f"unknown mode {mode!r}; accepted: {', '.join(EVAL_MODES)}")
    layer_major = mode == "layer"
    if layer_major and (cuda_graphs or fold or kv_buffer):
        raise EvalError(
            "mode 'layer' runs one forward per variant: cuda_graphs, fold and kv_buffer are the decode mode's"
        )
    steps = _check_int("steps", cfg.steps)
    prompt = _check_int("prompt", cfg.prompt, 0)
    batch = _check_int("batch", cfg.batch)
    seed = _check_int("seed", seed, 0)
    if not 0.0 < float(horizon_fraction) <= 1.0:
        raise EvalError(f"horizon_fraction must lie in (0, 1], got {horizon_fraction!r}")
    vlist = parse_eval_variants(variants, seed=seed)
    stored = [v.name for v in vlist if v.prompt_store is not None]
    if stored and not layer_major:
        raise EvalError(
            f"{', '.join(stored)}: a prompt store is emulated by --mode layer only (the decode mode's cache writer "
            "stores the prompt's state in the variant's own format)"
        )
    if stored and prompt == 0:
        raise EvalError(f"{', '.join(stored)}: a prompt store keeps the prompt's state: give --prompt N (N >= 1)")
    never = sorted({v.scheme.name for v in vlist if first_write_step(v) > steps}) if prompt == 0 else []
    if never:
        raise EvalError(
            f"{', '.join(never)} never stores its state within --steps {steps} (the first write would be after step "
            f"{max(first_write_step(v) for v in vlist)}), so its KL, top-1 agreement and loss change would read as a "
            "perfect score for nothing measured: raise --steps, lower --buffer-len, or give a --prompt (each variant "
            "stores the prompt's state once)"
        )
    text = _eval_text(text_path, prompt + steps, batch, cfg.text_split)

    if loaded is None:
        try:
            loaded = load_model(model, device=dev)
        except ModelLoadError as err:
            raise EvalError(str(err)) from None
    net = loaded.model
    fold = (loaded.device.type == "cuda" and not layer_major) if fold is None else bool(fold)
    layout = ssm_layout(net.config)  # the loaded config object: a re-parsed dict can fail validation
    state_shape = tuple(layout["state_shape"])
    try:
        check_variants_fit(vlist, (batch, *state_shape))
    except VariantError as err:
        raise EvalError(str(err)) from None
    layers = ssm_layers(net)
    if [layer.index for layer in layers] != list(layout["ssm_layers"]):
        raise EvalError(
            f"the model's SSM mixers sit at layers {[layer.index for layer in layers]} but its config says "
            f"{list(layout['ssm_layers'])}"
        )
    if not layer_major and not attention_layers(net.config):
        raise EvalError(
            f"{type(net).__name__} has no attention layer (a slice of a hybrid model?): transformers' cache sizes "
            "its causal mask from its attention layers and cannot decode it token by token; use --mode layer"
        )
    if fold_width is not None:
        fold_width = _check_int("fold_width", fold_width)
    exact = frozenset(i for i, v in enumerate(vlist) if v.format.is_exact)
    decoded = len(vlist) - len(exact) if fold else len(vlist)
    per_pass = None
    layer_estimate = None
    sub_batch = batch
    lower = "--prompt, --steps or --batch" if prompt else "--steps or --batch"
    try:
        if layer_major:
            sub_batch, layer_estimate = _layer_major_batch(
                net, layout, batch, prompt + steps, loaded.device, prompt, len(vlist)
            )
        elif fold and decoded:
            per_pass = _fold_width(net, layout, batch, prompt + steps, decoded, loaded.device, False, fold_width,
                                   prompt=prompt, lower=lower)  # fmt: skip
        else:
            est = _memory(net, layout, batch, prompt + steps, decoded, loaded.device, step_batch=batch,
                          exact=len(exact) == len(vlist), prompt=prompt)  # fmt: skip
            check_memory(est, batch=batch, steps=prompt + steps, free=free_bytes, lower=lower)
    except SizingError as err:
        raise EvalError(str(err)) from None

    try:
        ids = calibration_batch(
            batch, prompt + steps + 1, tokenizer=loaded.tokenizer, text=text, seed=seed, split=cfg.text_split
        )
    except TextError as err:
        raise EvalError(
            f"{prompt} prompt tokens and {steps} steps need {batch} sequences of {prompt + steps + 1} tokens "
            f"(the last token is only a target): {err}"
        ) from None
    embed = net.get_input_embeddings()
    ids = ids.to(embed.weight.device)
    byte_level = isinstance(loaded.tokenizer, ByteTokenizer)
    unit = "bits/byte" if byte_level else "bits/token"

    if threads is None:
        small = sum(p.numel() for p in net.parameters()) < SMALL_MODEL_PARAMS
        threads = 1 if (loaded.device.type == "cpu" and small) else torch.get_num_threads()
    threads = _check_int("threads", threads)

    writers = {i: StateWriter(v, layers, batch, steps, prompt=prompt > 0) for i, v in enumerate(vlist)}
    rows = CPU_ROW_MULTIPLE if loaded.device.type == "cpu" else 1
    plans = plan_passes(len(vlist), fold, per_pass, exact, rows)
    total = run_steps(plans, steps)
    done = 0
    notes = list(loaded.notes)
    if layer_major and notify is not None:
        notify(
            "memory: the layer mode needs about "
            + ", ".join(f"{format_bytes(layer_estimate.total(p))} on the {p}" for p in layer_estimate.pools)
            + f" ({sub_batch} sequence{'s' * (sub_batch > 1)} of {prompt + steps} positions per forward)"
        )
    if layer_major and sub_batch < batch:
        notes.append(
            f"memory: the layer mode runs {sub_batch} of the {batch} sequences per forward "
            f"({-(-batch // sub_batch)} forwards per variant)"
        )
        if notify is not None:
            notify(notes[-1])
    if len(plans) > 1:
        notes.append(
            f"memory: {per_pass} of {decoded} variants folded per pass with the reference, {len(plans)} passes "
            "(the reference is decoded again in each)"
        )
        if notify is not None:
            notify(notes[-1])
    dev = ids.device
    covered = 0  # the layer mode's sequences x forwards done
    values = torch.zeros(len(vlist), 3, batch, steps, dtype=torch.float64, device=dev)  # kl, agree, dnll (nats)
    ref_nll = torch.zeros(batch, steps, dtype=torch.float64, device=dev)
    clock = Clock(total_steps(plans, steps), dev, notify if steps > 8 else None)

    def advance(slices: int):
        nonlocal done
        done += slices
        if progress:
            progress(done, total)

    refusal = attention_refusal(loaded.device, cudnn_attention)
    if refusal is not None:
        raise EvalError(refusal)
    refusal = graph_refusal(net)
    if cuda_graphs and refusal is not None:
        raise EvalError(f"cuda_graphs was requested but {refusal}; use cuda_graphs=False or None")
    use_graphs = (refusal is None and not layer_major) if cuda_graphs is None else bool(cuda_graphs)
    segment_graphs = SegmentGraphs(net, backend_for(loaded.device)) if use_graphs else None

    t_loaded = time.time()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        allocator_before = _allocator_counts(dev)
    was_training = net.training
    net.eval()
    try:
        with (
            torch_threads(threads),
            # the layer-major pass validates the emulation's inputs, which tracks tensor versions: no_grad, not
            # inference_mode
            torch.no_grad() if layer_major else torch.inference_mode(),
            decode_attention(loaded.device, cudnn_attention),
            segment_graphs or contextlib.nullcontext(),
        ):
            if layer_major:
                def forward_done(sequences: int):
                    # the bar counts steps of whole-batch forwards; a forward of fewer sequences counts its share
                    nonlocal covered
                    before = covered * steps // batch
                    covered += sequences
                    advance(covered * steps // batch - before)

                recurrences = layer_major_pass(
                    net, ids, vlist, values, ref_nll, prompt=prompt, progress=forward_done, sub_batch=sub_batch
                )
            for n, plan in enumerate([] if layer_major else plans):
                notes += decode_pass(
                    net, ids, plan, writers, layers, state_shape, values, ref_nll if n == 0 else None, clock,
                    pass_no=n, passes=len(plans), progress=lambda slices=plan.slices: advance(slices),
                    kv_buffer=kv_buffer, prompt=prompt,
                )  # fmt: skip
    finally:
        net.train(was_training)
    decode_s = time.time() - t_loaded  # the loop ends on a host read of its checks: the device is done
    timing = {
        "load_s": round(t_loaded - t0, 3),
        "decode_s": round(decode_s, 3),
        "decode_steps_per_s": round(steps / decode_s, 3),  # layer mode: decode-step equivalents
        "mode": mode,
        # layer mode: what ran the SSM recurrences (the fused kernels' output mode, or the torch reference)
        **({"recurrences": [RECURRENCE_NAMES[b] for b in sorted(recurrences)]} if layer_major else {}),
        # layer mode: what compared the logits (evaluate.layer_major.chunk_metrics)
        **({"metrics": "fused kernel" if fused_metrics_default(dev) else "torch"} if layer_major else {}),
        **(
            {}
            if layer_estimate is None
            else {"memory_estimate_GiB": {p: round(layer_estimate.total(p) / 2**30, 3) for p in layer_estimate.pools}}
        ),
        "passes": len(plans),
        "forward_batch": [sum(len(r) for r in p.runs) * batch for p in plans] if fold else sub_batch,
    }
    if segment_graphs is not None:
        timing["cuda_graphs"] = {
            "segments": len(segment_graphs.segments),
            "layers": segment_graphs.layers,
            **segment_graphs.stats,
        }
        notes += [f"CUDA graphs: a segment could not be recorded and ran eagerly ({b})" for b in segment_graphs.broken]
    timing["check_every"] = CHECK_EVERY
    timing["window_steps_per_s"] = clock.window_rates()
    if dev.type == "cuda":
        timing["peak_gpu_memory_GiB"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 3)
        after = _allocator_counts(dev)
        timing["allocator"] = {k: after[k] - allocator_before[k] for k in after}

    vals = values.cpu().numpy()
    vals[:, 2] /= LN2  # delta loss in bits
    names = [v.name for v in vlist]
    window = horizon_window(steps, horizon_fraction, math.lcm(*[v.scheme.buffer_len for v in vlist]))
    positions = positions_frame(names, vals)
    summary = pd.DataFrame(
        [
            {
                "variant": v.name,
                "format": v.format.name,
                "scheme": v.scheme.name,
                "rounding": v.format.rounding.value,
                "buffer_len": v.scheme.buffer_len,
                "writes_per_seq": float(w.mask[:, int(w.prompt) :].sum(1).double().mean()),  # decode steps' writes
                **row,
            }
            for (v, w), row in zip(zip(vlist, writers.values()), summary_rows(vals, window))
        ]
    )
    nll_bits = ref_nll.cpu().numpy() / LN2
    reference = {
        "loss_unit": unit,
        "loss_mean": float(nll_bits.mean()),
        "loss_horizon": float(nll_bits[:, -window:].mean()),
        "horizon_window": window,
        "horizon_from": steps - window + 1,
    }
    source = _source(loaded, text_path, seed, batch, prompt + steps + 1, cfg.text_split)
    source.update(ssm_layers=[layer.index for layer in layers], state_shape=list(state_shape))
    config = EvalSettings(
        model=loaded.source.name if isinstance(model, LoadedModel) else str(model),
        variants=names,
        steps=steps,
        batch=batch,
        seed=seed,
        prompt=prompt,
        device=str(loaded.device) if isinstance(model, LoadedModel) else str(device),
        text=None if text_path is None else str(text_path),
        text_split=cfg.text_split,
        horizon_fraction=float(horizon_fraction),
        threads=threads,
        fold=bool(fold),
        variants_per_pass=per_pass,
        cuda_graphs=use_graphs,
        kv_buffer=bool(kv_buffer),
        cudnn_attention=bool(cudnn_attention),
        mode=mode,
    )
    return EvalResult(
        config=config,
        source=source,
        variants=vlist,
        positions=positions,
        summary=summary,
        reference=reference,
        sequences=sequences_frame(names, vals, window),
        environment=environment(
            loaded.device,
            weights_dtype=str(loaded.dtype).replace("torch.", ""),
            ssm_state_dtype="float32",
            **({} if loaded.device.type == "cuda" else {"cpu_threads": threads}),
        ),
        notes=notes,
        elapsed_s=time.time() - t0,
        timing=timing,
    )


# torch's CUDA caching allocator counters (torch.cuda.memory_stats): cudaMalloc / cudaFree calls (a cudaFree
# synchronises the device) and allocations retried after freeing the cache; their change over the decode loop
# says whether it allocates device memory step after step (growing tensors) or runs from the cache.
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _allocator_counts(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


def _layer_major_batch(net, layout: dict, batch: int, tokens: int, device, prompt: int, variants: int):
    """(sequences per forward, its memory estimate) of a layer-major evaluation: all ``batch`` when they fit the
    free memory, else the most that do. Raises SizingError (naming the estimate's parts) when one sequence does not
    fit."""
    lower = "--prompt or --steps" if prompt else "--steps"
    skipped = can_skip_scans(list(find_ssm_mixers(net).values()))
    err = None
    for sub in range(batch, 0, -1):
        est = _layer_major_memory(net, layout, sub, tokens, device, variants, skipped)
        # only one sequence's refusal is raised: its hint is searched over the positions (the attention scores grow
        # as their square, which an extrapolation from the per-token parts misses)
        at_tokens = (lambda n: _layer_major_memory(net, layout, 1, n, device, variants, skipped)) if sub == 1 else None
        try:
            check_memory(est, batch=sub, steps=tokens, free=free_bytes, lower=lower, at_steps=at_tokens)
            return sub, est
        except SizingError as e:
            err = e  # one sequence's: what to lower when not even that fits
    raise err


def _layer_major_memory(net, layout: dict, batch: int, tokens: int, device, variants: int, scans_skipped: bool):
    """``sizing.layer_major_memory`` for a loaded model: its largest SSM layer's sizes, hidden and MLP widths,
    attention layers, vocabulary, the number of variants, and whether its mixers' own scans are skipped
    (``scan_substitution.can_skip_scans``); the final hidden states in the output embedding's dtype (the head's
    matrix product takes them in its weight's dtype; ``net.dtype`` is only the first parameter's)."""
    text = net.config.get_text_config()
    return layer_major_memory(
        layout_dims(layout), text.to_dict(), batch=batch, tokens=tokens, vocab=int(text.vocab_size), device=device,
        variants=variants, attention=attention_dims(net.config),
        scans_skipped=scans_skipped, hidden_bytes=net.get_output_embeddings().weight.element_size(),
    )  # fmt: skip


def _memory(
    net,
    layout: dict,
    batch: int,
    steps: int,
    variants: int,
    device,
    *,
    step_batch: int,
    exact: bool = False,
    prompt: int = 0,
):
    """``sizing.eval_memory`` for a loaded model (its SSM layers, attention KV cache and vocabulary) plus the
    temporaries of one decode step: a Mamba-2 / GDN decode step's state-sized intermediates for the
    ``step_batch`` sequences of one forward (one layer at a time), one state write (``WRITE_GROUP_ELEMENTS``
    at most; none when every variant is exact) and the float64 log-probs of the metrics. ``steps``: the prompt's
    tokens and the decode steps (the KV caches hold both). ``prompt`` > 0: the prompt's prefill forward of
    ``batch`` sequences (``_prompt_prefill``)."""
    text = net.config.get_text_config()
    attention = attention_layers(net.config)
    heads = getattr(text, "num_attention_heads", 1) or 1
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    elem = next(net.parameters()).element_size()
    vocab = int(text.vocab_size)
    dims = layout_dims(layout)
    est = eval_memory(
        dims,
        batch=batch, steps=steps, variants=variants, ssm_layers=len(layout["ssm_layers"]), attention_layers=attention,
        kv_per_token=2 * kv_heads * head_dim * elem, vocab=vocab, device=device,
    )  # fmt: skip
    pool = "device" if torch.device(device).type == "cuda" else "host"
    per_seq = dims.state_elements  # one layer's state elements per sequence
    # transformers' torch decode step of one layer holds about four state-sized FP32 tensors (decay, input
    # term, new state, its copy for the output) for every sequence of the forward
    est.add("one decode step's state temporaries", pool, 4 * step_batch * per_seq * 4)
    if not exact:
        group = min(WRITE_GROUP_ELEMENTS, max(per_seq * batch, batch * per_seq * len(layout["ssm_layers"])))
        est.add("one state write", pool, group * WRITE_BYTES_PER_ELEMENT)
    est.add("float64 log-probs of the metrics", pool, 4 * batch * vocab * 8)
    if prompt:
        _prompt_prefill(est, net, dims, batch, prompt, device, elem)
    return est


def _prompt_prefill(est, net, dims, batch: int, prompt: int, device, elem: int) -> None:
    """Add the prompt's prefill forward to ``est``: ``loop.decode_pass`` prefills the first ``prompt`` tokens in one
    forward per run at the run's ``batch`` (a folded run is expanded after it), the runs one after another, so one
    such forward is live at a time. Its parts: the live activations (``sizing.prefill_bytes_per_token``), the
    larger of one attention layer's [batch, heads, prompt, prompt] scores where they are materialised (quadratic in
    the prompt) and KDA's scan decays (``sizing.prefill_layer_peak``), and the logits of every prompt position, which
    the forward returns (in the weights' dtype, and NemotronH's FP32 copy of them)."""
    text = net.config.get_text_config()
    config = text.to_dict()
    pool = "device" if torch.device(device).type == "cuda" else "host"
    per_token = prefill_bytes_per_token(dims, config)
    est.add(f"activations of the prompt's prefill ({batch} x {prompt} tokens)", pool, batch * prompt * per_token)
    what, peak = prefill_layer_peak(dims, config, attention_dims(net.config), prompt, device)
    if peak:
        est.add(peak_label(what, "the prompt's prefill", f"[batch, heads, {prompt}, {prompt}]"), pool, batch * peak)
    logit_bytes = elem + (FP32 if elem < FP32 else 0)
    est.add(f"logits of the prompt's prefill [{batch}, {prompt}, vocab]", pool,
            batch * prompt * int(text.vocab_size) * logit_bytes)  # fmt: skip


def _fold_width(
    net, layout, batch, steps, n_variants, device, exact, limit=None, *, prompt: int = 0, lower: str | None = None
) -> int:
    """The most variants (at most ``limit``) that one pass folds with the reference within the free memory:
    all of them when they fit. Raises SizingError when not even one fits (naming ``lower``, the options to lower).
    ``steps``: the prompt's tokens and the decode steps; ``prompt``: the prompt's tokens (its prefill, ``_memory``)."""
    err = None
    for k in range(min(n_variants, limit or n_variants), 0, -1):
        est = _memory(net, layout, batch, steps, k, device, step_batch=(k + 1) * batch, exact=exact, prompt=prompt)
        try:
            check_memory(est, batch=batch, steps=steps, free=free_bytes, lower=lower or "--steps or --batch")
            return k
        except SizingError as e:
            err = e  # the smallest run's: what to lower when not even one variant fits
    raise err


def summary_text(result: EvalResult, max_rows: int = 60) -> str:
    """The summary for the terminal."""
    cols = {
        "variant": "variant",
        "writes_per_seq": "writes/seq",
        "kl_mean": "KL mean",
        "kl_horizon": "KL horizon",
        "top1_agree_mean": "top-1 mean",
        "top1_agree_horizon": "top-1 horizon",
        "delta_loss_mean": "dloss mean",
        "delta_loss_horizon": "dloss horizon",
    }
    df = result.summary[list(cols)].rename(columns=cols)
    fmt = {c: (lambda v: f"{v:.2e}") for c in ("KL mean", "KL horizon")}
    fmt.update({c: (lambda v: f"{100 * v:.2f}%") for c in ("top-1 mean", "top-1 horizon")})
    fmt.update({c: (lambda v: f"{v:+.2e}") for c in ("dloss mean", "dloss horizon")})
    fmt["writes/seq"] = lambda v: f"{v:g}"
    text = df.head(max_rows).to_string(index=False, formatters=fmt)
    more = f"\n... {len(df) - max_rows} more rows in summary.csv" if len(df) > max_rows else ""
    ref = result.reference
    return (
        f"KL(p_fp32 || p_variant) in nats, top-1 agreement with the FP32-state model, and the change in loss "
        f"({ref['loss_unit']}); horizon = positions {ref['horizon_from']}..{result.config.steps}"
        + (f" of the decode after a {result.config.prompt}-token prompt" if result.config.prompt else "")
        + ". "
        f"FP32-state loss: {ref['loss_mean']:.4f} {ref['loss_unit']} (horizon {ref['loss_horizon']:.4f}).\n"
        f"{text}{more}"
    )


__all__ = [
    "DEFAULT_HORIZON_FRACTION",
    "EvalConfig",
    "EvalSettings",
    "EvalError",
    "EvalResult",
    "evaluate",
    "parse_eval_variants",
    "summary_text",
    "variant_grid",
]
