"""The MUFU tabulation's bookkeeping, run on the CPU with a stand-in for the GPU instructions."""

import torch

from ssmquant.engines import mufu


def _fake_launch(fn, x):
    """Correctly rounded results, except rcp of odd significands (+1 ulp) and ex2 of arguments below -0.5 (-1 ulp)."""
    if fn == "rcp":
        y = mufu.cr_rcp(x)
        odd = (x.view(torch.int32) & 1).bool()
        return torch.where(odd, (y.view(torch.int32) + 1).view(torch.float32), y)  # one ulp up in magnitude
    y = mufu.cr_ex2(x)
    return torch.where(x < -0.5, (y.view(torch.int32) - 1).view(torch.float32), y)


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
