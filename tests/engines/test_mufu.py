"""The MUFU tabulation's bookkeeping, run on the CPU with a stand-in for the GPU instructions."""

import pytest
import torch
import triton
import triton.language as tl

from lab.engines import mufu_tabulate
from ssmquant.engines import mufu
from ssmquant.kernels.mamba2_engine import _rcp


@triton.jit
def _rcp_kernel(x_ptr, y_ptr, tab_ptr, BLOCK: tl.constexpr):
    off = tl.arange(0, BLOCK)
    tl.store(y_ptr + off, _rcp(tl.load(x_ptr + off), tab_ptr))


def _fake_launch(fn, x):
    """Correctly rounded results, except rcp of odd significands (+1 ulp) and ex2 where the reduced argument
    (x in (-1, 0], else frac(x) - 1) lies below -0.5 (-1 ulp)."""
    if fn == "rcp":
        y = mufu.cr_rcp(x)
        odd = (x.view(torch.int32) & 1).bool()
        return torch.where(odd, (y.view(torch.int32) + 1).view(torch.float32), y)  # one ulp up in magnitude
    y = mufu.cr_ex2(x)
    xd = x.double()
    frac = xd - torch.floor(xd)
    reduced = torch.where(xd <= -1, torch.where(frac == 0, 0.0, frac - 1), xd)
    return torch.where(reduced < -0.5, (y.view(torch.int32) - 1).view(torch.float32), y)


def test_tabulate_records_deltas_and_checks_scale_invariance(monkeypatch):
    monkeypatch.setattr(mufu_tabulate, "_launch", _fake_launch)
    arrays, checks = mufu_tabulate.tabulate(torch.device("cpu"), samples=4096, rcp_bits=23, ex2_bits=12)
    rcp = torch.from_numpy(arrays["rcp_delta"])
    assert rcp.shape == (1 << 23,)
    assert torch.equal(rcp[1::2], torch.ones_like(rcp[1::2])) and not rcp[0::2].any()
    assert checks["rcp_scale_invariant"] == 1.0  # the fake is scale-invariant, so the rule must hold exactly
    ex2 = torch.from_numpy(arrays["ex2_delta"])
    x = -torch.arange(1 << 12, dtype=torch.float64) / 2**12
    assert torch.equal(ex2, torch.where(x < -0.5, -1, 0).to(torch.int8))
    assert arrays["ex2_x"].shape == arrays["ex2_y"].shape == (4096,)
    assert 0.0 <= checks["ex2_integer_part_split"] <= 1.0


def test_table_lookups_reproduce_the_tabulated_function(monkeypatch, tmp_path):
    import numpy as np

    monkeypatch.setattr(mufu_tabulate, "_launch", _fake_launch)
    arrays, checks = mufu_tabulate.tabulate(torch.device("cpu"), samples=64, rcp_bits=23, ex2_bits=24)
    path = tmp_path / "t.npz"
    np.savez_compressed(path, **arrays, checks=np.frombuffer(b"{}", dtype=np.uint8))
    tab = mufu_tabulate.load_tables(path)
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(4096, generator=g) * 2 + 0.01) * torch.exp2(torch.randint(-20, 20, (4096,), generator=g).float())
    x = torch.where(torch.rand(4096, generator=g) < 0.5, -x, x)
    assert torch.equal(mufu_tabulate.rcp_from_table(x, tab["rcp_delta"]), _fake_launch("rcp", x))
    v = -torch.cat([torch.rand(2048, generator=g) * 30, torch.exp2(-torch.rand(2048, generator=g) * 20)])
    v = torch.cat([v, torch.tensor([0.0, -1.0, -2.0, -0.5])])
    on_grid = (v >= -1) & (v.double() * 2**24 == torch.round(v.double() * 2**24))  # exact table arguments
    got = mufu_tabulate.ex2_from_table(v, tab["ex2_delta"])
    want = _fake_launch("ex2", v)
    assert torch.equal(got[on_grid | (v <= -1)], want[on_grid | (v <= -1)])
    with pytest.raises(ValueError, match="arguments <= 0"):
        mufu_tabulate.ex2_from_table(torch.tensor([0.5]), tab["ex2_delta"])


SAMPLES = __import__("pathlib").Path(__file__).parent / "data" / "mufu_sm90_samples.safetensors"


def _samples():
    from safetensors.torch import load_file

    return load_file(str(SAMPLES))


@pytest.mark.parametrize("fn", ["rcp", "ex2"])
def test_shipped_model_is_the_h200s_instruction_bit_for_bit(fn):
    # 4096 random arguments (rcp: exponents -60..60, both signs; ex2: -64..-2^-40) and 2048 table points, as the
    # H200 returned them (data/README.md); the model is built from the tables, the random ones are independent
    s = _samples()
    x = s[f"{fn}_x"].view(torch.float32)
    got = (mufu.rcp_sm90 if fn == "rcp" else mufu.ex2_sm90)(x).view(torch.int32)
    assert torch.equal(got, s[f"{fn}_y"]), int((got != s[f"{fn}_y"]).sum())
    # and the hardware is not the correctly rounded function: a model that ignores the deltas fails here
    ref = (mufu.cr_rcp(x) if fn == "rcp" else mufu.cr_ex2(torch.trunc(x.double() * 2**23).div(2**23).float())).view(torch.int32)
    assert float((ref == s[f"{fn}_y"]).float().mean()) < 0.9


def test_shipped_model_edges():
    inf = float("inf")
    x = torch.tensor([1.0, -2.0, 0.25, 2.0**126, 2.0**127, 0.0, -0.0, 1e-40, inf, -inf])
    want = torch.tensor([1.0, -0.5, 4.0, 2.0**-126, 0.0, inf, -inf, inf, 0.0, -0.0])  # ftz: 2^-127 and 1e-40 flush
    assert torch.equal(mufu.rcp_sm90(x).view(torch.int32), want.view(torch.int32))
    v = torch.tensor([0.0, -1.0, -3.0, -126.0, -126.5, -2.0**-24, -300.0, 3.0, 200.0, float("nan")])
    e = mufu.ex2_sm90(v)
    assert torch.equal(e[:6], torch.tensor([1.0, 0.5, 0.125, 2.0**-126, 0.0, 1.0]))  # 2^-24 truncates to 0
    assert e[6] == 0.0 and e[7] == 8.0 and e[8] == inf and torch.isnan(e[9])


def test_compact_packs_two_bits_and_refuses_an_untruncated_ex2(monkeypatch, tmp_path):
    codes = torch.randint(0, 4, (4096,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(mufu._unpack2(mufu._pack2(codes)), codes.to(torch.uint8))
    monkeypatch.setattr(mufu_tabulate, "_launch", _fake_launch)
    arrays, _ = mufu_tabulate.tabulate(torch.device("cpu"), samples=64, rcp_bits=23, ex2_bits=24)
    tables = {k: torch.from_numpy(v) for k, v in arrays.items()}
    # the fake's ex2 steps at x = -0.5 - 2^-24, inside a 2^-23 step: not the hardware's argument truncation
    with pytest.raises(ValueError, match="not truncated to 2\\^-23"):
        mufu_tabulate.compact(tables, tmp_path / "m.safetensors")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or TRITON_INTERPRET=1",
)
def test_triton_rcp_is_the_torch_model_bit_for_bit():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s = _samples()
    x = torch.cat([s["rcp_x"].view(torch.float32)[:2040], torch.tensor([2.0**126, 2.0**127, 0.0, 1e-40] * 2)])  # 2048
    y = torch.empty_like(x)
    x, y = x.to(dev), y.to(dev)
    _rcp_kernel[(1,)](x, y, mufu.sm90()["rcp_delta"].to(dev), BLOCK=x.numel())
    assert torch.equal(y.cpu().view(torch.int32), mufu.rcp_sm90(x.cpu()).view(torch.int32))
