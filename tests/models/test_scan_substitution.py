"""models.scan_substitution: the SSM mixers' own chunked scans skipped in a layer-major forward, through kernels'
kernelize, and restored after it. Oracle: the same forward with the scans run (bit-identical results), the real
scan's output (shape and dtype), the model's logits before the context (bit-identical after it)."""

import contextlib
import importlib.util
from types import MethodType

import pytest
import torch

from ssmquant import sizing
from ssmquant.evaluate import EvalError, layer_major
from ssmquant.kinds.base import LayerDims
from ssmquant.models import load_model
from ssmquant.models.mixers import find_ssm_mixers
from ssmquant.models.scan_substitution import can_skip_scans, skipped_scans
from ssmquant.replay.variants import parse_variant

MODELS = ("tiny-nemotron", "tiny-qwen", "tiny-kda")
needs_kernels = pytest.mark.skipif(
    importlib.util.find_spec("kernels") is None,
    reason="the kernels package (kernelize) is not installed: the scans run as before",
)


@pytest.fixture(scope="module", params=[(m, d) for m in MODELS for d in ("float32", "bfloat16")], ids=str)
def loaded(request):
    name, dtype = request.param
    return load_model(name, device="cpu", dtype=dtype).model


def _ids(net, length=40, batch=2):
    return torch.randint(0, 200, (batch, length), generator=torch.Generator().manual_seed(0))


def _scan_outputs(net, ids) -> list[torch.Tensor]:
    """Each SSM mixer's scan output as its gated norm receives it, over one forward."""
    seen, handles = [], []
    for mixer, tap in layer_major.layer_taps(net):
        norm = getattr(mixer.module, tap.norm)
        handles.append(norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone())))
    try:
        with torch.no_grad():
            net(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return seen


@needs_kernels
def test_the_placeholder_returns_zeros_of_the_real_scans_shape_and_dtype(loaded):
    ids = _ids(loaded)
    real = _scan_outputs(loaded, ids)
    mixers = list(find_ssm_mixers(loaded).values())
    assert can_skip_scans(mixers)
    with skipped_scans(mixers) as skipped:
        placeholder = _scan_outputs(loaded, ids)
    assert skipped and len(real) == len(placeholder) == len(mixers)
    for r, p in zip(real, placeholder):
        assert p.shape == r.shape and p.dtype == r.dtype and not p.any()
        assert r.abs().sum() > 0  # the real scan is not zeros: the placeholder did run in its place


@needs_kernels
def test_every_mixer_has_its_own_scan_again_after_the_context(loaded):
    ids = _ids(loaded)
    with torch.no_grad():
        before = loaded(input_ids=ids, use_cache=False).logits
    with skipped_scans(list(find_ssm_mixers(loaded).values())):
        pass
    with torch.no_grad():
        after = loaded(input_ids=ids, use_cache=False).logits
    assert torch.equal(before, after)
    for mixer in find_ssm_mixers(loaded).values():
        for wrapper in mixer.module._kernel_funcs.values():
            assert "forward" not in wrapper.__dict__ and "_kernel_repo" not in wrapper.__dict__


@needs_kernels
@pytest.mark.parametrize("prompt", [0, 8])
def test_layer_major_hidden_states_are_bit_identical_with_the_scans_skipped(loaded, prompt, monkeypatch):
    ids = _ids(loaded, length=24)
    variant = parse_variant("fp8_e4m3@conventional")
    with torch.no_grad():
        skipped = layer_major.variant_hidden(loaded, ids, variant, prompt)
        monkeypatch.setattr(layer_major, "skipped_scans", lambda mixers: contextlib.nullcontext(False))
        ran = layer_major.variant_hidden(loaded, ids, variant, prompt)
    assert torch.equal(skipped, ran)


def test_a_forward_that_does_not_replace_every_scan_output_is_refused(monkeypatch):
    net = load_model("tiny-qwen", device="cpu").model
    taps = layer_major.layer_taps(net)
    real_listen = layer_major.listen
    skip = taps[0][0].module
    monkeypatch.setattr(
        layer_major, "listen", lambda module, tap, cb: [] if module is skip else real_listen(module, tap, cb)
    )
    with torch.no_grad(), pytest.raises(EvalError, match=r"missed: \[0\]"):
        layer_major.variant_hidden(net, _ids(net, 16), parse_variant("fp8_e4m3"), 0, taps)


def test_the_layer_mode_estimate_leaves_out_the_scans_only_where_they_are_skipped():
    dims = LayerDims("mamba2", 64, 64, 128, 8)  # Nemotron-3-Nano's
    config = {"hidden_size": 2688, "intermediate_size": 1856, "chunk_size": 128}
    kw = dict(batch=1, tokens=32768, vocab=131072, device="cpu", variants=3)
    run = sizing.layer_major_memory(dims, config, **kw)
    skip = sizing.layer_major_memory(dims, config, scans_skipped=True, **kw)
    assert [p[0] for p in skip.parts][0] == "the forward's activations (the SSM mixers' own scans skipped)"
    assert skip.parts[0][2] < run.parts[0][2] / 2  # the scan's chunk tensors were most of it
    assert skip.parts[1:] == run.parts[1:]
    kda = LayerDims("kda", 4, 32, 48, 4)
    assert sizing.prefill_layer_peak(kda, {"chunk_size": 64}, None, 8192, "cpu", scan=False) == ("scores", 0)
    assert sizing.prefill_layer_peak(kda, {"chunk_size": 64}, None, 8192, "cpu")[0] == "pairs"


@needs_kernels
def test_an_exception_in_the_forward_still_restores_every_scan(loaded):
    mixers = list(find_ssm_mixers(loaded).values())
    with pytest.raises(RuntimeError, match="inside"), skipped_scans(mixers) as skipped:
        assert skipped
        raise RuntimeError("inside")
    for mixer in mixers:
        for wrapper in mixer.module._kernel_funcs.values():
            assert "forward" not in wrapper.__dict__ and "_kernel_repo" not in wrapper.__dict__


@needs_kernels
def test_the_mixers_other_layers_keep_their_own_forwards_during_and_after(loaded):
    """kernelize resets every extensible layer it walks; an instance forward set before (an accelerate hook's, an
    earlier kernelize's) must stay, during the forward and after it."""
    mixers = list(find_ssm_mixers(loaded).values())
    taps = dict((m.layer, t) for m, t in layer_major.layer_taps(loaded))
    calls = []
    patched = []
    for mixer in mixers:
        norm = getattr(mixer.module, taps[mixer.layer].norm)

        def hooked(self, *args, **kwargs):
            calls.append(1)
            return type(self).forward(self, *args, **kwargs)

        norm.forward = MethodType(hooked, norm)
        patched.append((norm, norm.__dict__["forward"]))
    try:
        with skipped_scans(mixers) as skipped:
            assert skipped
            with torch.no_grad():
                loaded(input_ids=_ids(loaded), use_cache=False, logits_to_keep=1)
        assert len(calls) == len(mixers)  # the instance forwards ran inside the context
        assert all(norm.__dict__.get("forward") is fwd for norm, fwd in patched)
    finally:
        for norm, _ in patched:
            norm.__dict__.pop("forward", None)


def test_no_scan_is_skipped_where_kernels_mappings_are_switched_off(monkeypatch):
    net = load_model("tiny-nemotron", device="cpu").model
    mixers = list(find_ssm_mixers(net).values())
    monkeypatch.setenv("DISABLE_KERNEL_MAPPING", "1")
    assert not can_skip_scans(mixers)
    with skipped_scans(mixers) as skipped:
        assert not skipped


@needs_kernels
def test_the_mixers_own_convolution_is_skipped_with_the_scan(loaded, monkeypatch):
    """The convolution feeds only the scan: within the context each mixer's convolution function runs on the probe's
    positions only, and the only full-length convolutions of a layer-major forward are the substitution's own
    derivations (one per SSM layer); without the context the mixers' run too."""
    from ssmquant.models.scan_substitution import CONV_FUNCTION, PROBE_POSITIONS

    mixers = list(find_ssm_mixers(loaded).values())
    assert all(
        any(getattr(f, "kernel_layer_name", None) == CONV_FUNCTION for f in m.module._kernel_funcs.values())
        for m in mixers
    )
    lengths = []
    real_conv = torch.nn.functional.conv1d

    def conv1d(x, *args, **kwargs):
        lengths.append(x.shape[-1])
        return real_conv(x, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "conv1d", conv1d)
    ids = _ids(loaded, length=40)
    variant = parse_variant("int8@conventional")
    with torch.no_grad():
        layer_major.variant_hidden(loaded, ids, variant)
    full = [n for n in lengths if n >= 40]  # padded to L + K - 1 by the torch path
    assert len(full) == len(mixers) and all(n <= PROBE_POSITIONS + 8 for n in lengths if n < 40), lengths
    lengths.clear()
    monkeypatch.setattr(layer_major, "skipped_scans", lambda mixers: contextlib.nullcontext(False))
    with torch.no_grad():
        layer_major.variant_hidden(loaded, ids, variant)
    assert len([n for n in lengths if n >= 40]) == 2 * len(mixers)
