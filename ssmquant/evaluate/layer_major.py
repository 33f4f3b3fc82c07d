"""Layer-major teacher forcing: each variant's whole sequence in one forward of the model.

Teacher forcing knows every token in advance, so layer L's outputs at every position depend only on the outputs of
the layers below it and on layer L's own stored state. One forward of the model over all P + T positions computes
them layer by layer: attention, MLP and MoE blocks as in a prefill, and at each SSM mixer a forward pre-hook on its
gated norm (``models.taps.listen``, the hook capture reads the mixer with) derives the recurrence inputs from the
mixer's own projections and replaces the mixer's scan output by the variant's per-step outputs, from
``simulate.simulate_outputs`` (the fused kernels' output mode on a GPU, the torch reference on the CPU): the
prompt's P steps in the FP32 recurrence, then the decode steps from the prompt's state stored once in the variant's
format (its prompt store first, where it names one), each step's output from the variant's stored state. The
reference is the same forward with the FP32 recurrence (``fp32@conventional``), so the reference and every variant
differ only by what the variant stores.

This computes what token-by-token decoding through the model's cache computes (``decode.TeacherForced``), up to
floating-point summation order: the blocks see all positions in one matmul instead of one row at a time, and the
recurrence runs as ssmquant's per-step loop (or kernel) instead of the model's own scan. The model's own chunked
scan, whose output is replaced, is skipped where transformers exposes it to kernels' kernelize
(``models.scan_substitution``: a placeholder returns zeros of its output's shape and dtype).
tests/evaluate/test_layer_major.py measures the agreement with the token-by-token path on the shipped models.

Memory: each forward keeps the final hidden states, not the logits; the metrics form the logits of the reference and
of every variant from them in chunks of positions (``sizing.metric_chunk_rows``) and compare them in a fused kernel on
a GPU (``kernels.metrics``; the float64 torch definition in ``metrics`` elsewhere), and where the batch's forward does not
fit the free memory, fewer sequences run per forward (``evaluate.run``). The recurrence is not chunked over
positions: one sequence's P + T positions of one layer's inputs and activations must fit.
"""

from __future__ import annotations

import torch

from .. import kinds
from ..kinds import after_prompt
from ..models.capture import mixer_taps
from ..models.mixers import find_ssm_mixers
from ..models.scan_substitution import skipped_scans
from ..models.taps import listen
from ..replay.variants import Variant, parse_variant
from ..simulate import simulate_outputs
from ..sizing import metric_chunk_rows
from .metrics import compare_step, reference_step
from .states import EvalError

REFERENCE_VARIANT = "fp32@conventional"


def _substitute(mixer, tap, variant: Variant, prompt: int, backends: set | None = None, replaced: list | None = None):
    """The norm pre-hook's callback: the mixer's scan output replaced by ``variant``'s outputs over all positions
    (the backends that computed them are added to ``backends``, the mixer's layer to ``replaced``)."""

    def at_norm(recorded: dict, args: tuple):
        raw = tap.derive(mixer.module, recorded)
        inputs = kinds.get(mixer.kind).inputs_type(**raw, meta={"layer": mixer.layer}).validate()
        runs = []
        if prompt:
            runs.append(simulate_outputs(inputs.slice_steps(0, prompt), [REFERENCE_VARIANT], final_state=True))
            runs.append(simulate_outputs(after_prompt(inputs, prompt, runs[0].final_state), [variant]))
            y = torch.cat([runs[0].outputs[0], runs[1].outputs[0]], dim=1)
        else:
            runs.append(simulate_outputs(inputs, [variant]))
            y = runs[0].outputs[0]
        if backends is not None:
            backends.update(r.backend for r in runs)
        scan = args[0]
        if scan.numel() != y.numel():
            raise EvalError(
                f"layer {mixer.layer}: the scan output has {scan.numel()} elements, the emulated outputs [B, T, H, "
                f"rows] {tuple(y.shape)}: the mixer's layout changed"
            )
        if replaced is not None:
            replaced.append(mixer.layer)
        return (y.reshape(scan.shape).to(scan.dtype), *args[1:])

    return at_norm


def layer_taps(net: torch.nn.Module) -> list:
    """(mixer, tap) of every SSM mixer of ``net``, as capture reads them (``models.capture.mixer_taps``)."""
    mixers = find_ssm_mixers(net)
    taps = mixer_taps(mixers)
    return [(mixer, taps[layer]) for layer, mixer in mixers.items()]


def variant_hidden(
    net: torch.nn.Module, ids: torch.Tensor, variant: Variant, prompt: int = 0, taps=None, backends: set | None = None
) -> torch.Tensor:
    """Final hidden states [B, L, D] (the output head's input) of the model over ``ids`` [B, L] with every SSM
    layer's recurrence replaced by ``variant``'s (the prompt's first ``prompt`` positions in FP32). taps:
    ``layer_taps(net)``, found here when not given; backends: a set that receives the backends that ran the
    recurrences ("triton", "torch").

    The mixers' own chunked scans, whose outputs the variant's replace, are skipped where transformers exposes them
    to kernels' kernelize (``models.scan_substitution``). The forward asks the model for the last position's logits
    only (``logits_to_keep=1``), keeps no cache
    (``use_cache=False``: no KV cache or SSM state of all positions; transformers' cache also cannot build the causal
    mask of a model without attention layers) and keeps its base model's output; ``head_logits`` of that output's
    last position must reproduce those logits bit for bit, else the model's head does more than its output
    embedding (a logit scale or soft cap) and EvalError says so; so does a forward that did not replace every SSM
    layer's scan output exactly once (the placeholder's zeros or the model's own scan would pass unnoticed)."""
    kept: dict = {}
    taps = layer_taps(net) if taps is None else taps
    replaced: list[int] = []
    handles = [net.base_model.register_forward_hook(lambda module, args, output: kept.update(hidden=output[0]))]
    try:
        for mixer, tap in taps:
            handles += listen(mixer.module, tap, _substitute(mixer, tap, variant, prompt, backends, replaced))
        with skipped_scans([mixer for mixer, _ in taps]):
            last = net(input_ids=ids, logits_to_keep=1, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    missed = sorted({mixer.layer for mixer, _ in taps} - set(replaced))
    if missed or len(replaced) != len(taps):
        raise EvalError(
            f"the forward replaced the scan outputs of SSM layers {sorted(replaced)}, once each expected of "
            f"{sorted(mixer.layer for mixer, _ in taps)} (missed: {missed}): the mixers' layout changed"
        )
    hidden = kept.get("hidden")
    if hidden is None or tuple(hidden.shape[:2]) != tuple(ids.shape):
        raise EvalError(
            f"the base model ({type(net.base_model).__name__}) did not return hidden states [B, L, D] for input ids "
            f"{tuple(ids.shape)}: the model's layout changed"
        )
    if not torch.equal(head_logits(net, hidden[:, -1:]), last.float()):
        raise EvalError(
            f"{type(net).__name__}'s logits are not its output embedding of the final hidden states (a logit scale "
            "or soft cap?): --mode layer computes the logits from the hidden states in chunks of positions and cannot "
            "evaluate it; use --mode decode"
        )
    return hidden


def head_logits(net: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """FP32 logits [..., V] of final hidden states [..., D] through the model's output embedding."""
    return net.get_output_embeddings()(hidden).float()


def fused_metrics_default(device: torch.device) -> bool:
    """Whether ``chunk_metrics`` takes the fused kernel by default on ``device``: on CUDA."""
    return device.type == "cuda"


def chunk_metrics(
    net: torch.nn.Module, hidden: list[torch.Tensor], targets: torch.Tensor, fused: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-position metrics of the final hidden states ``hidden`` (the reference's [R, D], then each variant's)
    against the reference's, with targets [R] -> (the reference's nll [R], values [V, 3, R]: kl, top-1 agreement,
    delta nll; float64, nats). The logits are formed through the output head in chunks of positions that hold
    ``sizing.METRIC_CHUNK_BYTES``, the reference's once per chunk for all variants. Raises EvalError where the
    reference's logits are not finite.

    fused (default: on CUDA): ``kernels.metrics.pair_metrics_triton`` compares the head's logits in their own dtype,
    about 2 x the logits' bytes per chunk instead of the torch path's float64 passes. Where a variant's logits are
    not finite (a diverged run), that variant's positions are measured by the torch path (``reference_step`` /
    ``compare_step``, the oracle of NaN and Inf), after one read-back of the kernel's flags."""
    dev, positions, count = hidden[0].device, hidden[0].shape[0], len(hidden) - 1
    vocab = net.get_output_embeddings().weight.shape[0]
    nll = torch.empty(positions, dtype=torch.float64, device=dev)
    measured = torch.empty(count, 3, positions, dtype=torch.float64, device=dev)
    if not (fused_metrics_default(dev) if fused is None else fused):
        _torch_metrics(net, hidden, targets, nll, measured)
        return nll, measured
    from ..kernels.metrics import REFERENCE_NONFINITE, pair_metrics_triton  # Triton: only where the fused path runs

    head = net.get_output_embeddings()
    flags = torch.zeros(max(count, 1), positions, dtype=torch.int32, device=dev)
    rows = metric_chunk_rows(vocab, 2 * head.weight.element_size())
    for r0 in range(0, positions, rows):
        chunk, target = slice(r0, r0 + rows), targets[r0 : r0 + rows]
        ref = head(hidden[0][chunk])
        for i in range(max(count, 1)):  # without variants, the reference against itself gives its nll
            values, flags[i, chunk] = pair_metrics_triton(ref, head(hidden[1 + i][chunk]) if count else ref, target)
            if count:
                measured[i, :, chunk] = values[:3]
            if i == 0:
                nll[chunk] = values[3]
    if bool((flags & REFERENCE_NONFINITE).any()):
        raise EvalError("the reference's logits are not finite")
    diverged = flags[:count].ne(0)
    redo = diverged.any(0).nonzero()[:, 0]
    if len(redo):
        _torch_metrics(net, [h[redo] for h in hidden], targets[redo], None, measured, redo, diverged[:, redo])
    return nll, measured


def _torch_metrics(net, hidden, targets, nll, measured, where=None, only=None) -> None:
    """chunk_metrics' torch path: fill ``nll`` [R] (unless None) and ``measured`` [V, 3, R] at the positions
    ``where`` (default: all) from the rows ``hidden`` and ``targets`` hold for them, each variant only where
    ``only`` [V, len(where)] is true (default: everywhere)."""
    rows = metric_chunk_rows(net.get_output_embeddings().weight.shape[0])
    for r0 in range(0, hidden[0].shape[0], rows):
        chunk = slice(r0, r0 + rows)
        at = chunk if where is None else where[chunk]
        logits = head_logits(net, hidden[0][chunk])
        if not torch.isfinite(logits).all():
            raise EvalError("the reference's logits are not finite")
        ref = reference_step(logits, targets[chunk])
        if nll is not None:
            nll[at] = ref.nll
        for i in range(measured.shape[0]):
            values = compare_step(ref, head_logits(net, hidden[1 + i][chunk]), targets[chunk])
            if only is None:
                measured[i, :, at] = values
            else:
                keep = only[i, chunk]
                measured[i, :, at[keep]] = values[:, keep]


def layer_major_pass(
    net: torch.nn.Module,
    ids: torch.Tensor,
    variants: list[Variant],
    values: torch.Tensor,
    ref_nll: torch.Tensor,
    prompt: int = 0,
    progress=None,
    sub_batch: int | None = None,
    fused_metrics: bool | None = None,
) -> set[str]:
    """Fill ``values`` [V, 3, B, T] (kl, top-1 agreement, delta nll in nats, as ``loop.decode_pass`` does) and
    ``ref_nll`` [B, T] for ``ids`` [B, P + T + 1], one forward of P + T positions per variant and one for the
    reference, ``sub_batch`` sequences at a time (default: all B). The final hidden states of the reference and of
    every variant are kept; the logits are then formed and compared in chunks of positions (``chunk_metrics``),
    the reference's once per chunk for all variants, so the metrics' memory does not grow with B x T. progress(sequences): called after each forward with the number of
    sequences it covered. fused_metrics: compare the logits with the fused kernel (``chunk_metrics``; default: on
    CUDA). Returns the backends that ran the recurrences (``simulate.simulate_outputs``: "triton"
    for the fused kernels' output mode, "torch" for the reference)."""
    batch, steps = ids.shape[0], ids.shape[1] - 1 - prompt
    sub_batch = batch if sub_batch is None else int(sub_batch)
    taps = layer_taps(net)
    backends: set[str] = set()
    for b0 in range(0, batch, sub_batch):
        part = ids[b0 : b0 + sub_batch]
        nb = part.shape[0]
        inputs, targets = part[:, :-1], part[:, prompt + 1 :].reshape(-1)
        hidden = []  # [1 + V] of [nb * T, D]: the reference's, then each variant's
        for v in [parse_variant(REFERENCE_VARIANT), *variants]:
            hidden.append(variant_hidden(net, inputs, v, prompt, taps, backends)[:, prompt:].reshape(nb * steps, -1))
            if progress is not None:
                progress(nb)
        targets = targets.to(hidden[0].device)
        nll, measured = chunk_metrics(net, hidden, targets, fused_metrics)
        ref_nll[b0 : b0 + nb] = nll.reshape(nb, steps)
        values[:, :, b0 : b0 + nb] = measured.reshape(len(variants), 3, nb, steps)
        del hidden
    return backends
