"""The MUFU tabulation's bookkeeping, run on the CPU with a stand-in for the GPU instructions."""

import pytest
import torch

from ssmquant.engines import mufu


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
    monkeypatch.setattr(mufu, "_launch", _fake_launch)
    arrays, checks = mufu.tabulate(torch.device("cpu"), samples=4096, rcp_bits=23, ex2_bits=12)
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

    monkeypatch.setattr(mufu, "_launch", _fake_launch)
    arrays, checks = mufu.tabulate(torch.device("cpu"), samples=64, rcp_bits=23, ex2_bits=24)
    path = tmp_path / "t.npz"
    np.savez_compressed(path, **arrays, checks=np.frombuffer(b"{}", dtype=np.uint8))
    tab = mufu.load_tables(path)
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(4096, generator=g) * 2 + 0.01) * torch.exp2(torch.randint(-20, 20, (4096,), generator=g).float())
    x = torch.where(torch.rand(4096, generator=g) < 0.5, -x, x)
    assert torch.equal(mufu.rcp_from_table(x, tab["rcp_delta"]), _fake_launch("rcp", x))
    v = -torch.cat([torch.rand(2048, generator=g) * 30, torch.exp2(-torch.rand(2048, generator=g) * 20)])
    v = torch.cat([v, torch.tensor([0.0, -1.0, -2.0, -0.5])])
    on_grid = (v >= -1) & (v.double() * 2**24 == torch.round(v.double() * 2**24))  # exact table arguments
    got = mufu.ex2_from_table(v, tab["ex2_delta"])
    want = _fake_launch("ex2", v)
    assert torch.equal(got[on_grid | (v <= -1)], want[on_grid | (v <= -1)])
    with pytest.raises(ValueError, match="arguments <= 0"):
        mufu.ex2_from_table(torch.tensor([0.5]), tab["ex2_delta"])
