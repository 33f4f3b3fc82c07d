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
recurrence runs as ssmquant's per-step loop (or kernel) instead of the model's own scan.
tests/evaluate/test_layer_major.py measures the agreement with the token-by-token path on the shipped models.
"""

from __future__ import annotations

import torch

from .. import kinds
from ..kinds import after_prompt
from ..models.capture import mixer_taps
from ..models.mixers import find_ssm_mixers
from ..models.taps import listen
from ..replay.variants import Variant, parse_variant
from ..simulate import simulate_outputs
from .metrics import compare_step, reference_step
from .states import EvalError

REFERENCE_VARIANT = "fp32@conventional"


def _substitute(mixer, tap, variant: Variant, prompt: int, backends: set | None = None):
    """The norm pre-hook's callback: the mixer's scan output replaced by ``variant``'s outputs over all positions
    (the backends that computed them are added to ``backends``)."""

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
        return (y.reshape(scan.shape).to(scan.dtype), *args[1:])

    return at_norm


def layer_taps(net: torch.nn.Module) -> list:
    """(mixer, tap) of every SSM mixer of ``net``, as capture reads them (``models.capture.mixer_taps``)."""
    mixers = find_ssm_mixers(net)
    taps = mixer_taps(mixers)
    return [(mixer, taps[layer]) for layer, mixer in mixers.items()]


def variant_logits(
    net: torch.nn.Module, ids: torch.Tensor, variant: Variant, prompt: int = 0, taps=None, backends: set | None = None
) -> torch.Tensor:
    """Logits [B, L, V] of the model over ``ids`` [B, L] with every SSM layer's recurrence replaced by ``variant``'s
    (the prompt's first ``prompt`` positions in FP32). taps: ``layer_taps(net)``, found here when not given;
    backends: a set that receives the backends that ran the recurrences ("triton", "torch")."""
    handles = []
    try:
        for mixer, tap in layer_taps(net) if taps is None else taps:
            handles += listen(mixer.module, tap, _substitute(mixer, tap, variant, prompt, backends))
        return net(input_ids=ids).logits
    finally:
        for h in handles:
            h.remove()


def layer_major_pass(
    net: torch.nn.Module,
    ids: torch.Tensor,
    variants: list[Variant],
    values: torch.Tensor,
    ref_nll: torch.Tensor,
    prompt: int = 0,
    progress=None,
) -> set[str]:
    """Fill ``values`` [V, 3, B, T] (kl, top-1 agreement, delta nll in nats, as ``loop.decode_pass`` does) and
    ``ref_nll`` [B, T] for ``ids`` [B, P + T + 1], one forward of P + T positions per variant and one for the
    reference. progress(): called after each forward. Returns the backends that ran the recurrences
    (``simulate.simulate_outputs``: "triton" for the fused kernels' output mode, "torch" for the reference)."""
    batch, steps = ids.shape[0], ids.shape[1] - 1 - prompt
    inputs, targets = ids[:, :-1], ids[:, prompt + 1 :]
    taps = layer_taps(net)
    backends: set[str] = set()
    ref_logits = variant_logits(net, inputs, parse_variant(REFERENCE_VARIANT), prompt, taps, backends)[:, prompt:]
    if not torch.isfinite(ref_logits).all():
        raise EvalError("the reference's logits are not finite")
    flat_target = targets.reshape(-1).to(ref_logits.device)
    ref = reference_step(ref_logits.reshape(batch * steps, -1), flat_target)
    ref_nll.copy_(ref.nll.reshape(batch, steps))
    if progress is not None:
        progress()
    for i, v in enumerate(variants):
        logits = variant_logits(net, inputs, v, prompt, taps, backends)[:, prompt:]
        values[i] = compare_step(ref, logits.reshape(batch * steps, -1), flat_target).reshape(3, batch, steps)
        if progress is not None:
            progress()
    return backends
