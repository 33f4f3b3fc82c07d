"""The `ssmquant` command line: click commands that parse, call the library and print."""

from __future__ import annotations

import sys

import click

from . import __version__
from .defaults import CPU_DEFAULTS, GPU_DEFAULTS
from .errors import SsmquantError
from .startup import finish, start_devices

INTERRUPTED = 128 + 2  # the shell's status for a command ended by SIGINT


USAGE_ERROR = 2  # click's status for a usage error (an unknown option, a bad or missing option value)


class _UsageError(click.ClickException):
    """A usage error as one `Error:` line (click prints three: usage, a hint, the error), status 2."""

    exit_code = USAGE_ERROR


def _one_line(err: click.UsageError) -> click.ClickException:
    if isinstance(err, getattr(click.exceptions, "NoArgsIsHelpError", ())):
        return err  # `ssmquant` alone: the help, as click prints it
    where = f" (see '{err.ctx.command_path} --help')" if err.ctx is not None else ""
    return _UsageError(err.format_message() + where)


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C is, so that the same clean-up runs (the output's
    temporary directory and lock removed) and the command ends with status 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def _stop_on_termination() -> dict:
    """Turn SIGTERM and SIGHUP into ``_Terminated`` while a command runs (main thread only; handlers a caller set
    stay). Returns the handlers replaced, for ``_restore_handlers``."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum, _frame):
        raise _Terminated(signum)

    previous = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) in (signal.SIG_DFL, None):
            previous[sig] = signal.signal(sig, stop)
    return previous


def _restore_handlers(previous: dict) -> None:
    import signal

    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _version_warnings_as_lines() -> None:
    """Print the library's UntestedVersionWarning (``models.compat``) and OutputWarning (``report.outdir``) as one
    `Warning:` line on stderr, not Python's two-line warning with a source path. Matched by class name: importing
    those modules here would load torch and pandas before every command."""
    import warnings

    if getattr(warnings.showwarning, "_ssmquant", False):
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if category.__name__ in ("UntestedVersionWarning", "OutputWarning"):
            click.echo(f"Warning: {message}", err=True)
        else:
            shown(message, category, filename, lineno, file, line)

    show._ssmquant = True
    warnings.showwarning = show


class _Group(click.Group):
    """Ctrl-C ends a command with status 130 (as the shell reports a SIGINT), not click's 1 ("Aborted!"); SIGTERM
    and SIGHUP with 128 + their number, through the same clean-up. Outputs are written atomically, so an
    interrupted run leaves no output directory behind. A usage error is
    one `Error:` line with status 2, as every other user error is one line (status 1)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as err:
            raise _one_line(err) from None

    def invoke(self, ctx):
        _version_warnings_as_lines()
        previous = _stop_on_termination()
        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            raise _one_line(err) from None
        except SsmquantError as err:  # any package's error for the user: one `Error:` line, status 1
            raise click.ClickException(str(err)) from None
        except KeyboardInterrupt as err:
            signum = getattr(err, "signum", None)
            click.echo("\nInterrupted." if signum is None else f"\nTerminated ({_signal_name(signum)}).", err=True)
            ctx.exit(INTERRUPTED if signum is None else 128 + signum)
        finally:
            _restore_handlers(previous)


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
    """The ``ssmquant`` console script and ``python -m ssmquant``: ``main``, then ``startup.finish`` (an exit that
    skips the interpreter's teardown after a command that succeeded)."""
    try:
        main(prog_name="ssmquant")
    except SystemExit as done:
        finish(done)


def _silence() -> None:
    """--quiet: keep transformers' informational warnings and loading bars and flash-linear-attention's CPU
    notice off the terminal (modelopt's version warning is off in every run: ``_quiet_modelopt``).

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
    warnings.filterwarnings("ignore", message=r"Triton is not supported on current platform.*")


MODELOPT_VERSION_WARNING = r"transformers \S+ is not tested with current version of modelopt"


def _quiet_modelopt() -> None:
    """Silence exactly nvidia-modelopt's warning at import (modelopt/torch/__init__.py) that the installed
    transformers "is not tested with current version of modelopt": calibrate imports modelopt (in
    ssmquant/calibrate) for its calibrators only, which are plain torch and never touch transformers, so the
    warning's advice (install modelopt[hf]'s pinned transformers) would only mislead; the floors job tests the
    versions pyproject admits. Any other warning of modelopt still shows."""
    import warnings

    warnings.filterwarnings("ignore", message=MODELOPT_VERSION_WARNING, category=UserWarning)


def _info(line: str) -> None:
    """A status line (defaults taken, estimates) on stderr, beside the progress bars; stdout holds results."""
    click.echo(line, err=True)


def _out_option(command: str, what: str = "Output directory."):
    return click.option(
        "--out",
        "out_dir",
        default=None,
        type=click.Path(file_okay=False),
        help=f"{what} [default: a new directory ssmquant-out/{command}-MODEL under the current one, named at the start]",
    )


def _out_dir(out_dir: str | None, command: str, model: str, synthetic: bool = False) -> str:
    """--out, or a new directory named after the model (``report.outdir.default_out_dir``), said on stderr (also
    with --quiet: it is where the results go)."""
    if out_dir is not None:
        return out_dir
    from .report.outdir import default_out_dir

    out = default_out_dir(command, model, synthetic=synthetic)
    _info(f"output: {out} (no --out given)")
    return str(out)


def _default_help(command: str, name: str, what: str) -> str:
    return f"{what} [default: {GPU_DEFAULTS[command][name]} on a GPU, {CPU_DEFAULTS[command][name]} on CPU]"


def _sizes(command: str, device: str, given: dict, quiet: bool) -> dict:
    """Fill the sizes the user left out with the defaults for the device the run computes on, and say so."""
    from .analysis.sources import resolve_device
    from .defaults import default_sizes, describe_defaults

    if all(v is not None for v in given.values()):
        return given
    dev = resolve_device(device)
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
        layers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(
            f"layers must be comma-separated integers, got {value!r}", param_hint="--layers"
        ) from None
    if not layers:
        raise click.BadParameter("give at least one layer index (comma-separated), or leave --layers out for all "
                                 "SSM layers", param_hint="--layers")  # fmt: skip
    return layers


DEVICES_ACCEPTED = "cuda:N (comma-separated, e.g. cuda:0,cuda:1), all, a count of GPUs, or cpu"


_DEVICES_OPTION = click.option(
    "--devices",
    default=None,
    help="Emulation devices: cuda:0,cuda:1 (comma-separated), all (every visible GPU) or a count N (cuda:0 .. "
    "cuda:N-1). Each layer is emulated on the GPU holding it, else round-robin; a checkpoint is spread over "
    "several of them. [default: --device alone]",
)


# Counts the commands take: out of range is a usage error (status 2, click's one line), as --prompt's is
_POSITIVE = click.IntRange(min=1)
_BUDGET = click.FloatRange(min=0, min_open=True)


def _finite(param, value: float, accepted: str) -> float:
    """click's FloatRange lets NaN through (every comparison with it is false)."""
    if value != value:
        raise click.BadParameter(f"nan is not in the range {accepted}", param=param)
    return value


def _nonempty(_ctx, param, value):
    """Refuse a blank value of an option whose absence means its default: '' must not silently become the default."""
    if value is not None and not str(value).strip():
        raise click.BadParameter("is empty; give a value or leave the option out for its default", param=param)
    return value


_PROMPT_STORE_OPTION = click.option(
    "--prompt-store",
    default=None,
    callback=_nonempty,
    help="Prompt stores (comma-separated; int8col: SGLang's int8 prefix cache, --enable-int8-mamba-checkpoint): each "
    "fp32 / bf16 / fp16 variant (calibrate: setting) runs again with the prompt's state kept in the store before its "
    "own format takes it over (name FORMAT@SCHEME+STORE). Needs --prompt.",
)
_PROMPT_OPTION = click.option(
    "--prompt",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Prompt tokens before decoding: the first N tokens of each sequence are prefilled in FP32 and each format "
    "stores the state they leave once (conventional: its state; replay: its first checkpoint), as an engine writes "
    "its prefill's final state; errors count the decode steps after it. 0: every token is a decode step from an "
    "empty state.",
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
    callback=_nonempty,
    help="Preset name, shipped model (tiny-nemotron, tiny-qwen, tiny-kda), local checkpoint dir or hub id. "
    "[default: tiny-nemotron]",
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
    default=None,
    help="Comma-separated formats (see `ssmquant formats`). [default: fp8_e4m3,int8,nvfp4; on KDA layers also "
    "bf16@conventional, the state its engines keep below float32]",
)
@click.option(
    "--schemes",
    default="conventional,replay",
    show_default=True,
    help="conventional, replay (buffer --buffer-len), replay<L>, spec<L>x<T>[:p<rate>].",
)
@click.option(
    "--buffer-len", default=16, show_default=True, type=_POSITIVE, help="Replay buffer length L for a bare 'replay'."
)
@click.option("--rounding", default="rne", show_default=True, help="rne, sr or rne,sr.")
@click.option(
    "--steps", default=None, type=_POSITIVE, help=_default_help("analyze", "steps", "Decode steps (after the prompt).")
)
@_PROMPT_OPTION
@_PROMPT_STORE_OPTION
@click.option("--batch", default=None, type=_POSITIVE, help=_default_help("analyze", "batch", "Sequences."))
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
    help="Engine profile(s) whose arithmetic is emulated: ideal, flashinfer, vllm, trtllm, sglang, or several side by side "
    "(ideal,vllm).",
)
@click.option(
    "--budget",
    default=0.02,  # analysis.fit.DEFAULT_BUDGET (not imported here: it would import torch at start-up)
    show_default=True,
    type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),  # analysis.fit.DIVERGED is 1
    callback=lambda _c, p, v: _finite(p, v, "0<x<1"),
    help="Error budget of the verdict: the largest allowed relative output error at any decode step (the worst step "
    "of every window), over the run and up to the 32K / 128K forecasts.",
)
@_out_option("analyze")
@click.option(
    "--force", is_flag=True, help="Replace --out when it holds a previous output of this command (nothing else)."
)
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
    prompt,
    prompt_store,
    batch,
    layers,
    device,
    devices,
    backend,
    record_every,
    seed,
    engine,
    budget,
    out_dir,
    force,
    no_plots,
    quiet,
):
    """Per-layer error of each state format over the decode horizon: tables, JSON, plots."""
    start_devices(device)
    from .analysis import AnalyzeConfig, analyze, default_model
    from .report.files import write_analysis
    from .report.outdir import claim_out_dir
    from .report.rendering import prefetch_plotting
    from .report.tables import memory_text, summary_table

    if quiet:
        _silence()
    model = model or default_model()
    sizes = _sizes("analyze", device, {"steps": steps, "batch": batch}, quiet)
    cfg = AnalyzeConfig(
        model=model,
        synthetic=synthetic,
        synthetic_profile=synthetic_profile,
        text=text,
        formats=_csv(formats if formats is not None else ",".join(AnalyzeConfig.DEFAULT_FORMATS), "--formats"),
        kind_baselines=formats is None,
        skip_unrunnable=formats is None,
        schemes=_csv(schemes, "--schemes"),
        buffer_len=buffer_len,
        rounding=_csv(rounding, "--rounding"),
        steps=sizes["steps"],
        prompt=prompt,
        prompt_stores=[] if prompt_store is None else _csv(prompt_store, "--prompt-store"),
        batch=sizes["batch"],
        layers=_layers(layers),
        device=device,
        backend=backend,
        seed=seed,
        record_every=record_every,
        engines=_csv(engine, "--engine"),
        devices=_devices(devices),
        budget=budget,
    )
    out_dir = _out_dir(out_dir, "analyze", model, synthetic)
    bar = _Bar(quiet, "layer", "analyze")

    def progress(done, total, layer):
        bar.update(done, total, "" if layer is None else f"layer {layer}")
        if done == 1 and not no_plots:
            # the plotting stack is imported while the device works: from the first layer done on (the next
            # layer's kernels are queued then), not before, where it would hold back the first launch
            prefetch_plotting()

    try:
        with claim_out_dir(out_dir, force, "analyze"):  # held from here: a second run into --out is refused now
            result = analyze(cfg, progress=progress, notify=None if quiet else bar.info)
            bar.close()
            path = write_analysis(result, out_dir, force=force, plots=not no_plots)
    finally:
        bar.close()
    if not quiet:
        src = result.source
        click.echo(f"\n{src['model']} ({src['kind']} data: {src.get('note', '')})")
        if cfg.prompt:
            click.echo(f"after a prompt of {cfg.prompt} tokens (prefilled in FP32, stored once per format): errors "
                       f"over the {cfg.steps} decode steps that follow")  # fmt: skip
        click.echo(summary_table(result.summary))
        click.echo("\n" + memory_text(result.memory))
        click.echo(f"\nwrote {path} in {result.elapsed_s:.1f} s")


@main.command("plot")
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
def plot_cmd(out_dir):
    """Re-render the plots of an `ssmquant analyze` output directory from its saved traces."""
    from .report.files import replot

    files = replot(out_dir)
    click.echo("wrote " + ", ".join(files))


@main.command("presets")
def presets_cmd():
    """List the model presets and the shipped models with their SSM state per sequence (FP32 and each format)."""
    from .report.tables import presets_table

    click.echo(presets_table())


@main.command("build")
@click.argument("preset")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option(
    "--device", default="auto", show_default=True, help="Where the model is materialised: auto, cpu, cuda, cuda:N."
)
@click.option(
    "--dtype", default="bfloat16", show_default=True, help="Weights dtype on disk: bfloat16, float16, float32."
)
@click.option("--layers", "num_layers", type=int, default=None, help="Keep the first N decoder layers only.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors shard.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--overrides", default=None, help="Config fields as a JSON object, e.g. '{\"hidden_size\": 64}'.")
def build_cmd(preset, out_dir, device, dtype, num_layers, max_shard_size, seed, overrides):
    """Write a full-size checkpoint of PRESET with random weights into OUT_DIR (no download)."""
    import json

    from .analysis.sources import resolve_device
    from .models.build import build_random_checkpoint, estimate_parameters

    try:
        fields = json.loads(overrides) if overrides else None
    except json.JSONDecodeError as err:
        raise click.BadParameter(f"must be a JSON object of config fields: {err}", param_hint="--overrides") from None
    if fields is not None and not isinstance(fields, dict):
        raise click.BadParameter(f"must be a JSON object of config fields, got {overrides!r}", param_hint="--overrides")
    dev = str(resolve_device(device))
    n = estimate_parameters(preset, num_layers=num_layers, overrides=fields)
    click.echo(f"{preset}: {n / 1e9:.2f} B parameters, {n * 2 / 2**30:.1f} GiB in 16-bit; building on {dev}")
    build_random_checkpoint(preset, out_dir, dtype=dtype, device=dev, num_layers=num_layers,
                            max_shard_size=max_shard_size, seed=seed, overrides=fields)  # fmt: skip


@main.command("eval")
@click.option(
    "--model",
    default=None,
    callback=_nonempty,
    help="Shipped model (tiny-nemotron, tiny-qwen, tiny-kda), local checkpoint dir or hub id. [default: tiny-nemotron]",
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
    "--buffer-len", default=16, show_default=True, type=_POSITIVE, help="Replay buffer length L for a bare 'replay'."
)
@click.option("--rounding", default=None, help="rne, sr or rne,sr. [default: rne]")
@click.option(
    "--steps", default=None, type=_POSITIVE, help=_default_help("eval", "steps", "Decode steps (after the prompt).")
)
@_PROMPT_OPTION
@click.option(
    "--batch", default=None, type=_POSITIVE, help=_default_help("eval", "batch", "Held-out sequences decoded together.")
)
@click.option("--device", default="auto", show_default=True, help="auto, cuda, cuda:N or cpu.")
@click.option(
    "--text",
    "text",
    type=click.Path(exists=True, dir_okay=False),
    help="Text file whose held-out split is decoded (default: the shipped public-domain corpus).",
)
@click.option(
    "--text-split",
    type=click.Choice(["heldout", "all"]),
    default="heldout",
    show_default=True,
    help="heldout: the text's last 20%, never calibrated on; all: the whole text, for a text the model never saw "
    "(evaluation calibrates nothing; the tiny models' held-out documents: studies/tiny_models/CORPUS.md).",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for text selection and stochastic rounding.")
@_out_option("eval")
@click.option(
    "--force", is_flag=True, help="Replace --out when it holds a previous output of this command (nothing else)."
)
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
@click.option(
    "--mode",
    type=click.Choice(["decode", "layer"]),
    default=None,
    help="decode: teacher-forced token by token through the model's cache; layer: each variant's whole sequence in "
    "one forward, every SSM layer's recurrence replaced by the emulated variant's outputs (the same function up to "
    "summation order; the fused kernels run the recurrences on a GPU, the torch reference on a CPU). "
    "[default: layer on a GPU, decode on a CPU]",
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
    prompt,
    batch,
    device,
    text,
    text_split,
    seed,
    out_dir,
    force,
    no_plots,
    fold,
    cudnn_attention,
    mode,
    quiet,
):
    """End to end: decode held-out text with each variant's stored SSM state; KL, top-1 agreement, loss change vs FP32."""
    from .analysis import default_model
    from .evaluate import EvalConfig, evaluate, parse_eval_variants, summary_text, variant_grid, write_eval
    from .report.outdir import claim_out_dir

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
    out_dir = _out_dir(out_dir, "eval", model)
    bar = _Bar(quiet, "step", "eval (reference + variants) x steps")
    try:
        with claim_out_dir(out_dir, force, "eval"):  # held from here: a second run into --out is refused now
            if variants is not None:
                chosen = parse_eval_variants(_csv(variants, "--variants"), seed=seed, buffer_len=buffer_len)
            else:
                chosen = variant_grid(
                    _csv(formats if formats is not None else "fp8_e4m3,int8,nvfp4", "--formats"),
                    _csv(schemes if schemes is not None else "conventional,replay", "--schemes"),
                    _csv(rounding or "rne", "--rounding"),
                    buffer_len,
                    seed,
                )
            cfg = EvalConfig(
                model, chosen, steps=sizes["steps"], batch=sizes["batch"], seed=seed, device=device, text=text, fold=fold,
                cudnn_attention=cudnn_attention, prompt=prompt, mode=mode, text_split=text_split,
            )  # fmt: skip
            result = evaluate(
                cfg,
                progress=bar.update,
                notify=None if quiet else bar.info,
            )
            bar.close()
            path = write_eval(result, out_dir, force, plots=not no_plots)
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
    callback=_nonempty,
    help="Preset name (with --synthetic), shipped model (tiny-nemotron, tiny-qwen, tiny-kda), local checkpoint dir or "
    "hub id. [default: tiny-nemotron]",
)
@click.option("--synthetic", is_flag=True, help="Synthetic inputs with a preset's exact shapes (no weights).")
@click.option(
    "--text",
    "text",
    type=click.Path(exists=True, dir_okay=False),
    help="Text file: its calibration split calibrates, its held-out split verifies (default: the shipped corpus).",
)
@click.option(
    "--budget",
    default=0.02,  # analysis.fit.DEFAULT_BUDGET, as analyze's
    show_default=True,
    type=_BUDGET,
    help="Error budget: the largest allowed metric at the horizon.",
)
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
    type=_POSITIVE,
    help=_default_help(
        "calibrate", "horizon", "Decode steps (after the prompt); the budget holds over the last window."
    ),
)
@_PROMPT_OPTION
@_PROMPT_STORE_OPTION
@click.option(
    "--batch", default=None, type=_POSITIVE, help=_default_help("calibrate", "batch", "Calibration sequences.")
)
@click.option(
    "--heldout-batch", default=None, type=_POSITIVE, help="Held-out sequences for verification. [default: --batch]"
)
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
    default="fp16,bf16,fp32",
    show_default=True,
    help="Float dtypes measured for the export when an engine cannot take the chosen one, and chosen per layer "
    "with --choose-among engines where they are the cheapest within the budget ('none' to skip).",
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
    help="Engine profile whose arithmetic emulates every candidate: ideal, flashinfer, vllm, trtllm or sglang; a setting the "
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
@click.option(
    "--choose-among",
    default="engines",
    show_default=True,
    type=click.Choice(["engines", "research"]),
    help="engines: choose among the settings that the engines checked (--engine-version, --gpu) run as measured on "
    "these layers, float fallbacks included; research: among every candidate, what no engine runs yet too. The "
    "summary shows the other pool's cheapest setting per layer beside the choice.",
)
@click.option("--no-verify", is_flag=True, help="Skip the held-out verification.")
@_out_option("calibrate", "Recipe directory.")
@click.option(
    "--force", is_flag=True, help="Replace --out when it holds a previous output of this command (nothing else)."
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or table.")
def calibrate_cmd(
    model,
    synthetic,
    text,
    budget,
    metric,
    horizon,
    prompt,
    prompt_store,
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
    choose_among,
    no_verify,
    out_dir,
    force,
    quiet,
):
    """Choose per SSM layer the cheapest state storage within an error budget; write a verified recipe."""
    from .analysis import default_model
    from .calibrate import BudgetError, CalibrateConfig, calibrate, write_recipe
    from .calibrate.summary import summary_text, verification_failure
    from .report.outdir import claim_out_dir

    _quiet_modelopt()
    if quiet:
        _silence()
    model = model or default_model()
    sizes = _sizes("calibrate", device, {"horizon": horizon, "batch": batch}, quiet)
    try:
        lens = [int(v) for v in _csv(buffer_lens, "--buffer-lens")]
    except ValueError:
        raise click.BadParameter(f"integers expected, got {buffer_lens!r}", param_hint="--buffer-lens") from None
    fallbacks = _csv(engine_fallbacks, "--engine-fallbacks")
    cfg = CalibrateConfig(
        model=model,
        synthetic=synthetic,
        text=text,
        budget=budget,
        metric=metric,
        horizon=sizes["horizon"],
        prompt=prompt,
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
        choose_among=choose_among,
        prompt_stores=[] if prompt_store is None else _csv(prompt_store, "--prompt-store"),
    )
    out_dir = _out_dir(out_dir, "calibrate", model, synthetic)
    # one bar per stage (calibrate, verify), moving within a layer too; its postfix is calibrate's own time left,
    # verification included (tqdm's rate would see the current stage only)
    bar = {"stage": None, "tqdm": None, "left": None}
    fmt = "{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total_fmt} layers [{elapsed}{postfix}]"

    def close_bar():
        if bar["tqdm"] is not None:
            bar["tqdm"].close()
            bar["tqdm"] = None

    def progress(stage, done, total, layer):
        if quiet:
            return
        if bar["stage"] != stage or bar["tqdm"] is None:
            from tqdm import tqdm

            close_bar()
            bar["stage"], bar["tqdm"] = stage, tqdm(total=total, desc=stage, bar_format=fmt, leave=True)
        t = bar["tqdm"]
        t.n = round(float(done), 1)
        left = bar["left"]
        parts = ([] if layer is None else [f"layer {layer}"]) + (
            [] if left is None else [left.short() + (" (verification included)" if stage == "calibrate" and cfg.verify else "")]
        )  # fmt: skip
        t.set_postfix_str(", ".join(parts), refresh=False)
        t.refresh()

    def time_left(left):
        bar["left"] = left

    def notify(line):
        if bar["tqdm"] is not None:
            bar["tqdm"].write(line, file=sys.stderr)
        else:
            _info(line)

    try:
        with claim_out_dir(out_dir, force, "calibrate"):  # held from here: a second run into --out is refused now
            result = calibrate(cfg, progress=progress, notify=None if quiet else notify, time_left=time_left)
            close_bar()
            path = write_recipe(result, out_dir, force=force)
    except BudgetError as err:
        raise _BudgetNotMet(str(err)) from None
    finally:
        close_bar()
    if not quiet:
        src = result.source
        click.echo(f"\n{src.get('model')} ({src.get('kind')} data: {src.get('note', '')})")
        click.echo(summary_text(result))
        click.echo(f"\nwrote {path} in {result.elapsed_s:.1f} s")
    failed = verification_failure(result)
    if failed:  # the recipe is written (marked), so that the user can inspect it; the status says it failed
        err = click.ClickException(
            f"{failed}; the recipe was still written to {path}, marked verification.passed = false, to inspect "
            "(calibrate on more data: --batch, --horizon, or with a lower --budget)"
        )
        err.exit_code = 4
        raise err


def _engine_versions(pairs) -> dict[str, str]:
    """('vllm=0.33.0', ...) -> {'vllm': '0.33.0'} (names and versions are checked by calibrate)."""
    out = {}
    for pair in pairs:
        engine, sep, version = pair.partition("=")
        if not sep or not engine.strip() or not version.strip():
            raise click.BadParameter(
                f"expected ENGINE=VERSION, e.g. vllm=0.33.0, got {pair!r}", param_hint="--engine-version"
            )
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
    "--force",
    is_flag=True,
    help="Replace the output directory (--out or the default RECIPE_DIR/export-TARGET) when it holds a previous export (nothing else).",
)
@click.option(
    "--speculative-method",
    default=None,
    help="The drafter, needed by vllm and trtllm whenever the export drafts tokens: mtp, ngram, eagle, eagle3, "
    "draft_model (TensorRT-LLM: mtp, ngram, eagle3, draft_model).",
)
@click.option("--speculative-model", default=None, help="The drafter's checkpoint (eagle, eagle3, draft_model).")
def export_cmd(
    recipe_dir, target, out_dir, num_speculative_tokens, engine_version, gpu, force, speculative_method,
    speculative_model,
):  # fmt: skip
    """Turn a recipe into the files vLLM, TensorRT-LLM or FlashInfer take, and report what they cannot take.

    The terminal gets a short report; EXPORT.md in the output directory has the engine's words for each
    dropped setting, the facts relied on and every note.
    """
    from .export import export

    result = export(
        recipe_dir,
        target,
        out_dir,
        num_speculative_tokens=num_speculative_tokens,
        force=force,
        engine_version=engine_version,
        gpu=gpu,
        speculative_method=speculative_method,
        speculative_model=speculative_model,
    )
    for line in result.report_lines():
        click.echo(line)
    click.echo(f"wrote {result.out_dir}: " + ", ".join(result.files))
