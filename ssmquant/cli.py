"""The `ssmquant` command line: click commands that parse, call the library and print."""

from __future__ import annotations

import sys

import click

from . import __version__
from .sizing import CPU_DEFAULTS, GPU_DEFAULTS

INTERRUPTED = 128 + 2  # the shell's status for a command ended by SIGINT


class _Group(click.Group):
    """Ctrl-C ends a command with status 130 (as the shell reports a SIGINT), not click's 1 ("Aborted!").
    Outputs are written atomically, so an interrupted run leaves no output directory behind."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\nInterrupted.", err=True)
            ctx.exit(INTERRUPTED)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ssmquant")
def main():
    """Can the SSM state of a hybrid LLM be stored in FP8, INT8 or NVFP4? Measure it, calibrate it, export it."""


@main.command("formats")
@click.option(
    "--shape",
    default="64,64,128",
    show_default=True,
    help="State shape heads,rows,state_dim to size the table for (default: a Nemotron-3-Nano layer).",
)
def formats_cmd(shape: str):
    """List the state storage formats with their footprint."""
    from .report.tables import formats_table, parse_shape

    click.echo(formats_table(parse_shape(shape)))


def entry() -> None:
    """The ``ssmquant`` console script and ``python -m ssmquant``: ``main``, and after a command that succeeded
    an exit that skips the interpreter's teardown (unloading torch, Triton and CUDA's context: a large part
    of a short GPU run's wall clock). Every command has written and renamed its files, joined its worker
    threads and printed its output by then; only stdout and stderr remain to flush."""
    import os

    try:
        main(prog_name="ssmquant")
    except SystemExit as done:
        if done.code in (0, None):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        raise


def _start_cuda(device: str) -> None:
    """Create the CUDA context in a background thread while the command imports the rest (pandas, Triton,
    the analysis modules): torch's ops release the GIL, so the driver's start-up overlaps the imports. torch
    itself is imported here, in the calling thread, before that thread starts.

    Triton's warm-up (``_warm_up_triton``) runs in a thread of its own, started before torch's import where an
    NVIDIA GPU is likely (``_likely_nvidia_gpu``: no torch needed to tell), else once torch sees a GPU. Its
    import of ``triton.runtime.cache`` does not import torch, nor does torch's import import Triton, so the two
    imports cannot wait on each other; should the command's own import of Triton meet it, Python's per-module
    import locks make one wait for the other. Started after torch's import, it raced the first launch: in the
    H200 profile of run t3 (2026-12-01) the first launch still spent 0.66 s on the host, most of it reading and
    hashing libtriton.so. Errors are left to the command's own device checks, which name the problem."""
    if device == "cpu":
        return
    import threading

    def warm_triton():
        try:
            _warm_up_triton()
        except Exception:  # noqa: BLE001, S110 - the first launch computes it, or fails with its own message
            pass

    early = _likely_nvidia_gpu()
    if early:
        # before torch's import, which takes 1.3-5.8 s on the H200 machines and holds the GIL while the hash does
        # not: the hash (0.6-0.9 s) is done by the first launch instead of racing it
        threading.Thread(target=warm_triton, name="ssmquant-triton-key", daemon=True).start()

    import torch

    def start():
        try:
            if torch.cuda.is_available():
                if not early:
                    threading.Thread(target=warm_triton, name="ssmquant-triton-key", daemon=True).start()
                dev = torch.device(device) if device.startswith("cuda:") else torch.device("cuda", 0)
                torch.zeros(1, device=dev)
        except Exception:  # noqa: BLE001, S110 - reported by the command itself
            pass

    threading.Thread(target=start, name="ssmquant-cuda-start", daemon=True).start()


def _likely_nvidia_gpu() -> bool:
    """Whether an NVIDIA GPU is likely usable, judged without importing torch: the driver's control device
    exists, CUDA_VISIBLE_DEVICES does not hide every GPU, and Triton is installed. Used to start Triton's warm-up
    before torch's import; a wrong guess costs a background hash on an idle core, never a result."""
    import importlib.util
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") and importlib.util.find_spec("triton") is not None


def _warm_up_triton() -> None:
    """Compute what Triton's first kernel call in a process computes whatever the kernel: the hash of Triton's
    own installation that keys its cache (``triton.runtime.cache.triton_key``, Triton >= 3.3: a SHA-256 of its
    compiler sources and of libtriton.so, about 500 MB; 0.28 s on the 2-core CPU machine), cached for the
    process by ``functools.lru_cache``. Called from a thread of ``_start_cuda``: hashing and reading release the
    GIL, so it overlaps the command's imports, the CUDA context's creation and the first layer's inputs.
    Should the first launch come first, it computes the same value itself; nothing depends on this having run."""
    from triton.runtime.cache import triton_key

    triton_key()


def _silence() -> None:
    """--quiet: keep transformers' informational warnings and loading bars, modelopt's version warning and
    flash-linear-attention's CPU notice off the terminal.

    transformers is configured through the environment variables it reads at import (TRANSFORMERS_VERBOSITY
    in transformers/utils/logging.py, HF_HUB_DISABLE_PROGRESS_BARS in huggingface_hub/constants.py), so that
    a run that loads no checkpoint (--synthetic) never imports it (about 0.4 s); once imported, its API."""
    import os
    import warnings

    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    else:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    warnings.filterwarnings("ignore", message=r".*is not tested with current version of modelopt.*")
    warnings.filterwarnings("ignore", message=r"Triton is not supported on current platform.*")


def _info(line: str) -> None:
    """A status line (defaults taken, estimates) on stderr, beside the progress bars; stdout holds results."""
    click.echo(line, err=True)


def _default_help(command: str, name: str, what: str) -> str:
    return f"{what} [default: {GPU_DEFAULTS[command][name]} on a GPU, {CPU_DEFAULTS[command][name]} on CPU]"


def _sizes(command: str, device: str, given: dict, quiet: bool) -> dict:
    """Fill the sizes the user left out with the defaults for the device the run computes on, and say so."""
    from .analysis.sources import SourceError, resolve_device
    from .sizing import default_sizes, describe_defaults

    if all(v is not None for v in given.values()):
        return given
    try:
        dev = resolve_device(device)
    except SourceError as err:
        raise click.ClickException(str(err)) from None
    defaults = default_sizes(command, dev)
    chosen = {k: defaults[k] if v is None else v for k, v in given.items()}
    if not quiet:
        _info(describe_defaults(command, dev, {k: chosen[k] for k, v in given.items() if v is None}))
    return chosen


class _Bar:
    """A tqdm bar created at the first update (so that nothing is drawn before the work starts) and closed
    by ``close`` (so that an error message starts on its own line)."""

    def __init__(self, quiet: bool, unit: str, desc: str):
        self.quiet, self.unit, self.desc, self.bar = quiet, unit, desc, None

    def update(self, done: int, total: int, postfix: str | None = None) -> None:
        if self.quiet:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=self.unit, desc=self.desc, leave=True)
        self.bar.total = total
        self.bar.n = done
        if postfix is not None:
            self.bar.set_postfix_str(postfix)
        self.bar.refresh()

    def info(self, line: str) -> None:
        """A status line, above the bar when one is drawn."""
        if self.bar is None:
            _info(line)
        else:
            self.bar.write(line, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _errors() -> tuple[type[Exception], ...]:
    """The exceptions that carry a user-facing message: printed as one `Error:` line, no traceback."""
    from .analysis import AnalyzeError, SourceError
    from .formats import FormatError
    from .models import CaptureError, ModelLoadError, TextError
    from .replay.inputs import InputError
    from .replay.simulate import BackendError
    from .report.files import OutputError
    from .sizing import SizingError

    return (
        AnalyzeError, SourceError, OutputError, FormatError, InputError, SizingError, BackendError, CaptureError,
        TextError, ModelLoadError,
    )  # fmt: skip


def _csv(value: str | None, name: str) -> list[str] | None:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise click.BadParameter("give at least one value (comma-separated)", param_hint=name)
    return items


def _layers(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(
            f"layers must be comma-separated integers, got {value!r}", param_hint="--layers"
        ) from None


DEVICES_ACCEPTED = "cuda:N (comma-separated, e.g. cuda:0,cuda:1), all, a count of GPUs, or cpu"


_DEVICES_OPTION = click.option(
    "--devices",
    default=None,
    help="Emulation devices: cuda:0,cuda:1 (comma-separated), all (every visible GPU) or a count N (cuda:0 .. "
    "cuda:N-1). Each layer is emulated on the GPU holding it, else round-robin; a checkpoint is spread over "
    "several of them. [default: --device alone]",
)


def _devices(value: str | None) -> list[str] | str | None:
    """--devices: names, "all", or a count N (cuda:0 .. cuda:N-1), checked against the visible GPUs here so
    that a bad value is one line before any work (analysis.devices.parse_emulation_devices)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        n = int(value)
        if n < 1:
            raise click.BadParameter(f"a count of GPUs must be >= 1, got {n}; accepted: {DEVICES_ACCEPTED}",
                                     param_hint="--devices")  # fmt: skip
        value = ",".join(f"cuda:{i}" for i in range(n))
    import torch

    from .analysis.devices import DeviceError, parse_emulation_devices

    try:
        parse_emulation_devices(value, torch.device("cpu"))
    except DeviceError as err:
        msg = str(err) if "accepted" in str(err) else f"{err}; accepted: {DEVICES_ACCEPTED}"
        raise click.BadParameter(msg, param_hint="--devices") from None
    return value


@main.command("analyze")
@click.option(
    "--model",
    default=None,
    help="Preset name, shipped model (tiny-nemotron, tiny-qwen), local checkpoint dir or hub id. [default: tiny-nemotron]",
)
@click.option(
    "--synthetic", is_flag=True, help="Synthetic inputs with a preset's exact shapes (no weights, no download)."
)
@click.option(
    "--synthetic-profile",
    default="init",
    show_default=True,
    help="Dynamics of --synthetic inputs: init (the family's init law) or a labelled stress profile: "
    "slow-decay, low-rank-keys, outliers, persistent (all three).",
)
@click.option(
    "--text",
    "text",
    type=click.Path(exists=True, dir_okay=False),
    help="Calibration text file (default: the shipped public-domain corpus).",
)
@click.option(
    "--formats",
    default="fp8_e4m3,int8,nvfp4",
    show_default=True,
    help="Comma-separated formats (see `ssmquant formats`).",
)
@click.option(
    "--schemes",
    default="conventional,replay",
    show_default=True,
    help="conventional, replay (buffer --buffer-len), replay<L>, spec<L>x<T>[:p<rate>].",
)
@click.option(
    "--buffer-len", default=16, show_default=True, type=int, help="Replay buffer length L for a bare 'replay'."
)
@click.option("--rounding", default="rne", show_default=True, help="rne, sr or rne,sr.")
@click.option("--steps", default=None, type=int, help=_default_help("analyze", "steps", "Decode steps (tokens per sequence)."))
@click.option("--batch", default=None, type=int, help=_default_help("analyze", "batch", "Sequences."))
@click.option("--layers", default=None, help="Comma-separated decoder-layer indices of SSM layers (default: all).")
@click.option("--device", default="auto", show_default=True, help="auto, cuda or cpu.")
@_DEVICES_OPTION
@click.option(
    "--backend",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "torch", "triton"]),
    help="auto: Triton kernels on a GPU, the torch reference on CPU.",
)
@click.option(
    "--record-every",
    default=None,
    type=int,
    help="Window length in steps: every step is measured and each window keeps the mean, max and last "
    "error [default: whole flush cycles of every variant, at most 1024 windows].",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="Seed for text selection, synthetic inputs and stochastic rounding.",
)
@click.option(
    "--engine",
    default="ideal",
    show_default=True,
    help="Engine profile(s) whose arithmetic is emulated: ideal, flashinfer, vllm, trtllm, or several side by side "
    "(ideal,vllm).",
)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or tables.")
def analyze_cmd(
    model,
    synthetic,
    synthetic_profile,
    text,
    formats,
    schemes,
    buffer_len,
    rounding,
    steps,
    batch,
    layers,
    device,
    devices,
    backend,
    record_every,
    seed,
    engine,
    out_dir,
    force,
    no_plots,
    quiet,
):
    """Per-layer error of each state format over the decode horizon: tables, JSON, plots."""
    _start_cuda(device)
    from .analysis import AnalyzeConfig, analyze, default_model
    from .report.files import check_out_dir, prefetch_plotting, write_analysis
    from .report.tables import memory_text, summary_table

    if quiet:
        _silence()
    sizes = _sizes("analyze", device, {"steps": steps, "batch": batch}, quiet)
    cfg = AnalyzeConfig(
        model=model or default_model(),
        synthetic=synthetic,
        synthetic_profile=synthetic_profile,
        text=text,
        formats=_csv(formats, "--formats"),
        schemes=_csv(schemes, "--schemes"),
        buffer_len=buffer_len,
        rounding=_csv(rounding, "--rounding"),
        steps=sizes["steps"],
        batch=sizes["batch"],
        layers=_layers(layers),
        device=device,
        backend=backend,
        seed=seed,
        record_every=record_every,
        engines=_csv(engine, "--engine"),
        devices=_devices(devices),
    )
    bar = _Bar(quiet, "layer", "analyze")

    def progress(done, total, layer):
        bar.update(done, total, "" if layer is None else f"layer {layer}")
        if done == 1 and not no_plots:
            # the plotting stack is imported while the device works: from the first layer done on (the next
            # layer's kernels are queued then), not before, where it would hold back the first launch
            prefetch_plotting()

    try:
        check_out_dir(out_dir, force, "analyze")
        result = analyze(cfg, progress=progress, notify=None if quiet else bar.info)
        bar.close()
        path = write_analysis(result, out_dir, force=force, plots=not no_plots)
    except _errors() as err:
        raise click.ClickException(str(err)) from None
    finally:
        bar.close()
    if not quiet:
        src = result.source
        click.echo(f"\n{src['model']} ({src['kind']} data: {src.get('note', '')})")
        click.echo(summary_table(result.summary))
        click.echo("\n" + memory_text(result.memory))
        click.echo(f"\nwrote {path} in {result.elapsed_s:.1f} s")


@main.command("plot")
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
def plot_cmd(out_dir):
    """Re-render the plots of an `ssmquant analyze` output directory from its saved traces."""
    from .report.files import OutputError, replot

    try:
        files = replot(out_dir)
    except OutputError as err:
        raise click.ClickException(str(err)) from None
    click.echo("wrote " + ", ".join(files))


@main.command("presets")
def presets_cmd():
    """List the model presets with their SSM state per sequence (FP32 and each format)."""
    from .report.tables import presets_table

    click.echo(presets_table())


@main.command("eval")
@click.option(
    "--model",
    default=None,
    help="Shipped model (tiny-nemotron, tiny-qwen), local checkpoint dir or hub id. [default: tiny-nemotron]",
)
@click.option(
    "--variants",
    default=None,
    help="Comma-separated format@scheme variants, e.g. fp8_e4m3@conventional,int8:sr@replay16,nvfp4@spec16x4:p0.8 "
    "(instead of --formats/--schemes/--rounding).",
)
@click.option("--formats", default=None, help="Comma-separated formats. [default: fp8_e4m3,int8,nvfp4]")
@click.option(
    "--schemes",
    default=None,
    help="conventional, replay (buffer --buffer-len), replay<L>, spec<L>x<T>[:p<rate>]. [default: conventional,replay]",
)
@click.option(
    "--buffer-len", default=16, show_default=True, type=int, help="Replay buffer length L for a bare 'replay'."
)
@click.option("--rounding", default=None, help="rne, sr or rne,sr. [default: rne]")
@click.option("--steps", default=None, type=int, help=_default_help("eval", "steps", "Decode steps (tokens per sequence)."))
@click.option("--batch", default=None, type=int, help=_default_help("eval", "batch", "Held-out sequences decoded together."))
@click.option("--device", default="auto", show_default=True, help="auto, cuda, cuda:N or cpu.")
@click.option(
    "--text",
    "text",
    type=click.Path(exists=True, dir_okay=False),
    help="Text file whose held-out split is decoded (default: the shipped public-domain corpus).",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for text selection and stochastic rounding.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plot.")
@click.option(
    "--fold/--no-fold",
    default=None,
    help="Decode the FP32 reference and the variants as one batch, one forward per step (--fold), or one forward "
    "each (--no-fold). [default: fold on a GPU, not on the CPU]",
)
@click.option(
    "--cudnn-attention",
    is_flag=True,
    help="On a GPU, let torch pick the attention kernel (cuDNN's first on H100 / H200) instead of the default, torch's "
    "choice without cuDNN (flash attention): cuDNN builds a plan for every new KV length (a slower first run) and its "
    "results are not bit-identical from run to run.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or table.")
def eval_cmd(
    model,
    variants,
    formats,
    schemes,
    buffer_len,
    rounding,
    steps,
    batch,
    device,
    text,
    seed,
    out_dir,
    force,
    no_plots,
    fold,
    cudnn_attention,
    quiet,
):
    """End to end: decode held-out text with each variant's stored SSM state; KL, top-1 agreement, loss change vs FP32."""
    from .analysis import default_model
    from .evaluate import EvalError, evaluate, parse_eval_variants, summary_text, variant_grid, write_eval
    from .report.files import check_out_dir

    if variants is not None and (formats or schemes or rounding):
        raise click.UsageError("give either --variants or --formats/--schemes/--rounding, not both")
    if quiet:
        _silence()
    if model is None:
        from .models import available_shipped_models

        if not available_shipped_models():
            raise click.UsageError("no shipped model is installed; pass --model with a checkpoint directory or hub id")
        model = default_model()
    sizes = _sizes("eval", device, {"steps": steps, "batch": batch}, quiet)
    bar = _Bar(quiet, "step", "eval (reference + variants) x steps")
    try:
        check_out_dir(out_dir, force, "eval")
        if variants is not None:
            chosen = parse_eval_variants(_csv(variants, "--variants"), seed=seed, buffer_len=buffer_len)
        else:
            chosen = variant_grid(
                _csv(formats or "fp8_e4m3,int8,nvfp4", "--formats"),
                _csv(schemes or "conventional,replay", "--schemes"),
                _csv(rounding or "rne", "--rounding"),
                buffer_len,
                seed,
            )
        result = evaluate(
            model,
            chosen,
            steps=sizes["steps"],
            batch=sizes["batch"],
            seed=seed,
            device=device,
            text_path=text,
            fold=fold,
            cudnn_attention=cudnn_attention,
            progress=bar.update,
            notify=None if quiet else bar.info,
        )
        bar.close()
        path = write_eval(result, out_dir, force, plots=not no_plots)
    except (EvalError, *_errors()) as err:
        raise click.ClickException(str(err)) from None
    finally:
        bar.close()
    if not quiet:
        src = result.source
        click.echo(f"\n{src['model']} ({src['kind']}: {src['note']})")
        click.echo(summary_text(result))
        for note in result.notes:
            click.echo(f"note: {note}")
        click.echo(f"\nwrote {path} in {result.elapsed_s:.1f} s")


class _BudgetNotMet(click.ClickException):
    """No candidate meets the budget: the table is the message; exit status 3, no recipe written."""

    exit_code = 3


@main.command("calibrate")
@click.option(
    "--model",
    default=None,
    help="Preset name (with --synthetic), shipped model, local checkpoint dir or hub id. [default: tiny-nemotron]",
)
@click.option("--synthetic", is_flag=True, help="Synthetic inputs with a preset's exact shapes (no weights).")
@click.option(
    "--text",
    "text",
    type=click.Path(exists=True, dir_okay=False),
    help="Text file: its calibration split calibrates, its held-out split verifies (default: the shipped corpus).",
)
@click.option("--budget", required=True, type=float, help="Error budget: the largest allowed metric at the horizon.")
@click.option(
    "--metric",
    default="out_rel_err",
    show_default=True,
    type=click.Choice(["out_rel_err", "state_rel_err", "out_rel_err_max", "state_rel_err_max"]),
    help="Relative error of the layer output or of the state, pooled over sequences and heads, over the "
    "horizon window (the last ~1/64 of the horizon, whole flush cycles): RMS over its steps, or its worst "
    "step (_max).",
)
@click.option(
    "--horizon",
    default=None,
    type=int,
    help=_default_help("calibrate", "horizon", "Decode steps; the budget holds over the last window."),
)
@click.option("--batch", default=None, type=int, help=_default_help("calibrate", "batch", "Calibration sequences."))
@click.option("--heldout-batch", default=None, type=int, help="Held-out sequences for verification. [default: --batch]")
@click.option("--candidates", default="fp8_e4m3,int8,nvfp4", show_default=True, help="Candidate formats.")
@click.option(
    "--schemes",
    default="replay,conventional",
    show_default=True,
    help="conventional, replay (one per --buffer-lens), replay<L>, spec<L>x<T>[:p<rate>].",
)
@click.option("--buffer-lens", default="4,8,16", show_default=True, help="Replay buffer lengths for a bare 'replay'.")
@click.option("--rounding", default="rne", show_default=True, help="rne, sr or rne,sr.")
@click.option(
    "--calibration",
    default="max,percentile,mse",
    show_default=True,
    help="Static-scale methods: max, percentile[:p] (default 99.99), mse; 'none' for dynamic scales only.",
)
@click.option(
    "--calibration-granularity", default="row", show_default=True, help="Static scales per row, per head, or row,head."
)
@click.option(
    "--engine-fallbacks",
    default="fp16,bf16",
    show_default=True,
    help="Float dtypes measured for the export when an engine cannot take the chosen one ('none' to skip).",
)
@click.option("--ignore-buffer-bytes", is_flag=True, help="Rank by checkpoint bytes only (leave the replay ring out).")
@click.option("--global", "force_global", is_flag=True, help="One engine-takeable setting for all layers.")
@click.option("--layers", default=None, help="Comma-separated decoder-layer indices of SSM layers (default: all).")
@click.option("--device", default="auto", show_default=True, help="auto, cuda, cuda:N or cpu.")
@_DEVICES_OPTION
@click.option(
    "--backend",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "torch", "triton"]),
    help="auto: Triton kernels on a GPU, the torch reference on CPU.",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for data selection and stochastic rounding.")
@click.option(
    "--engine",
    default="ideal",
    show_default=True,
    help="Engine profile whose arithmetic emulates every candidate: ideal, flashinfer, vllm or trtllm; a setting the "
    "engine cannot run is reported with its reason and never chosen (export checks the recipe against its target).",
)
@click.option(
    "--engine-version",
    "engine_versions",
    multiple=True,
    metavar="ENGINE=VERSION",
    help="Engine version that 'engine-takeable' is checked for, e.g. vllm=0.33.0+pr52962 (repeatable; as "
    "`ssmquant export --engine-version`). [default: each engine's newest release covered]",
)
@click.option(
    "--gpu",
    default=None,
    help="GPU that 'engine-takeable' is checked for: sm80, sm90, sm100, ... [default: the local GPU, else sm90]",
)
@click.option("--no-verify", is_flag=True, help="Skip the held-out verification.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Recipe directory.")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or table.")
def calibrate_cmd(
    model,
    synthetic,
    text,
    budget,
    metric,
    horizon,
    batch,
    heldout_batch,
    candidates,
    schemes,
    buffer_lens,
    rounding,
    calibration,
    calibration_granularity,
    engine_fallbacks,
    ignore_buffer_bytes,
    force_global,
    layers,
    device,
    devices,
    backend,
    seed,
    engine,
    engine_versions,
    gpu,
    no_verify,
    out_dir,
    force,
    quiet,
):
    """Choose per SSM layer the cheapest state storage within an error budget; write a verified recipe."""
    from .analysis import default_model
    from .calibrate import BudgetError, CalibrateConfig, CalibrateError, calibrate, write_recipe
    from .calibrate.summary import summary_text
    from .report.files import check_out_dir

    if quiet:
        _silence()
    sizes = _sizes("calibrate", device, {"horizon": horizon, "batch": batch}, quiet)
    try:
        lens = [int(v) for v in _csv(buffer_lens, "--buffer-lens")]
    except ValueError:
        raise click.BadParameter(f"integers expected, got {buffer_lens!r}", param_hint="--buffer-lens") from None
    fallbacks = _csv(engine_fallbacks, "--engine-fallbacks")
    cfg = CalibrateConfig(
        model=model or default_model(),
        synthetic=synthetic,
        text=text,
        budget=budget,
        metric=metric,
        horizon=sizes["horizon"],
        batch=sizes["batch"],
        heldout_batch=heldout_batch,
        candidates=_csv(candidates, "--candidates"),
        schemes=_csv(schemes, "--schemes"),
        buffer_lens=lens,
        rounding=_csv(rounding, "--rounding"),
        calibration=_csv(calibration, "--calibration"),
        calibration_granularity=_csv(calibration_granularity, "--calibration-granularity"),
        engine_fallbacks=[] if fallbacks == ["none"] else fallbacks,
        count_buffer=not ignore_buffer_bytes,
        force_global=force_global,
        layers=_layers(layers),
        device=device,
        backend=backend,
        seed=seed,
        verify=not no_verify,
        engine_versions=_engine_versions(engine_versions),
        gpu=gpu,
        devices=_devices(devices),
        engine=engine,
    )
    bars: dict[str, _Bar] = {}

    def progress(stage, done, total, layer):
        if stage not in bars:
            for b in bars.values():
                b.close()
            bars[stage] = _Bar(quiet, "layer", stage)
        bars[stage].update(done, total, "" if layer is None else f"layer {layer}")

    def notify(line):
        drawn = [b for b in bars.values() if b.bar is not None]
        (drawn[-1].info if drawn else _info)(line)

    try:
        check_out_dir(out_dir, force, "calibrate")
        result = calibrate(cfg, progress=progress, notify=None if quiet else notify)
        for b in bars.values():
            b.close()
        path = write_recipe(result, out_dir, force=force)
    except BudgetError as err:
        raise _BudgetNotMet(str(err)) from None
    except (CalibrateError, *_errors()) as err:
        raise click.ClickException(str(err)) from None
    finally:
        for b in bars.values():
            b.close()
    if not quiet:
        src = result.source
        click.echo(f"\n{src.get('model')} ({src.get('kind')} data: {src.get('note', '')})")
        click.echo(summary_text(result))
        click.echo(f"\nwrote {path} in {result.elapsed_s:.1f} s")


def _engine_versions(pairs) -> dict[str, str]:
    """('vllm=0.33.0', ...) -> {'vllm': '0.33.0'} (names and versions are checked by calibrate)."""
    out = {}
    for pair in pairs:
        engine, sep, version = pair.partition("=")
        if not sep or not engine.strip() or not version.strip():
            raise click.BadParameter(f"expected ENGINE=VERSION, e.g. vllm=0.33.0, got {pair!r}", param_hint="--engine-version")
        out[engine.strip().lower()] = version.strip()
    return out


@main.command("export")
@click.argument("recipe_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--target", required=True, help="vllm, trtllm or flashinfer.")
@click.option(
    "--out", "out_dir", default=None, type=click.Path(file_okay=False), help="[default: RECIPE_DIR/export-TARGET]"
)
@click.option(
    "--num-speculative-tokens",
    default=None,
    type=int,
    help="Draft tokens per step of the deployment (checked against the replay buffer length).",
)
@click.option(
    "--engine-version",
    default=None,
    help="Engine version the export is checked for: a release whose source the engine facts cover, or a build "
    "with open PRs (vLLM 0.33.0+pr52962). [default: the newest release covered]",
)
@click.option(
    "--gpu",
    default=None,
    help="GPU the export is checked for, as its compute capability: sm80, sm90, sm100, sm120, ... "
    "[default: the local GPU, else sm90]",
)
@click.option(
    "--force", is_flag=True, help="Replace a non-empty output directory (--out or the default RECIPE_DIR/export-TARGET)."
)
def export_cmd(recipe_dir, target, out_dir, num_speculative_tokens, engine_version, gpu, force):
    """Turn a recipe into the files vLLM, TensorRT-LLM or FlashInfer take, and report what they cannot take."""
    from .export import ExportError, export

    try:
        result = export(
            recipe_dir,
            target,
            out_dir,
            num_speculative_tokens=num_speculative_tokens,
            force=force,
            engine_version=engine_version,
            gpu=gpu,
        )
    except ExportError as err:
        raise click.ClickException(str(err)) from None
    for line in result.report_lines():
        click.echo(line)
    click.echo(f"wrote {result.out_dir}: " + ", ".join(result.files))


if __name__ == "__main__":  # pragma: no cover
    entry()
