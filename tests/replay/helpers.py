"""Random decode inputs for replay / kernel tests, with realistic decays and bf16 inputs."""

import torch
import torch.nn.functional as F

from ssmquant.kinds import GDNInputs, KDAInputs, Mamba2Inputs


def mamba2_inputs(
    batch=2, steps=63, heads=4, head_dim=60, groups=2, state=40, seed=0, device="cpu", dtype=torch.bfloat16
):
    """Mamba-2 inputs with per-head decays from fast to slow (a_t from ~0.5 to ~0.9999)."""
    g = torch.Generator().manual_seed(seed)
    x = F.silu(torch.randn(batch, steps, heads, head_dim, generator=g)).to(dtype)
    b = F.silu(torch.randn(batch, steps, groups, state, generator=g)).to(dtype)
    c = F.silu(torch.randn(batch, steps, groups, state, generator=g)).to(dtype)
    dt_bias = torch.linspace(-6.0, 0.0, heads)
    dt = F.softplus(torch.randn(batch, steps, heads, generator=g) * 0.5 + dt_bias).clamp(min=1e-3)
    A = -torch.exp(torch.linspace(-1.0, 2.0, heads))
    D = torch.linspace(0.5, 1.5, heads)
    inp = Mamba2Inputs(x=x, dt=dt.to(dtype).float(), B=b, C=c, A=A, D=D)
    return inp.to(device)


def gdn_inputs(batch=2, steps=63, key_heads=2, value_heads=4, dk=40, dv=60, seed=0, device="cpu", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, steps, key_heads, dk, generator=g), dim=-1) / dk**0.5
    k = F.normalize(torch.randn(batch, steps, key_heads, dk, generator=g), dim=-1)
    v = torch.randn(batch, steps, value_heads, dv, generator=g)
    a_log = torch.linspace(-3.0, 1.0, value_heads)
    gate = -torch.exp(a_log) * F.softplus(torch.randn(batch, steps, value_heads, generator=g) - 2.0)
    beta = torch.sigmoid(torch.randn(batch, steps, value_heads, generator=g))
    inp = GDNInputs(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=gate, beta=beta)
    return inp.to(device)


def kda_inputs(batch=2, steps=63, key_heads=2, value_heads=4, dk=40, dv=60, seed=0, device="cpu", dtype=torch.bfloat16):
    """KDA inputs whose key channels decay at different rates inside every head (half-lives ~1 to ~1000
    steps), with GLM-5.3-Flash's bounded gate: g = -5 sigmoid(f + dt_bias) in [-5, 0]."""
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, steps, key_heads, dk, generator=g), dim=-1) / dk**0.5
    k = F.normalize(torch.randn(batch, steps, key_heads, dk, generator=g), dim=-1)
    v = torch.randn(batch, steps, value_heads, dv, generator=g)
    dt_bias = torch.linspace(-12.0, 0.0, dk)[torch.randperm(dk, generator=g)]  # per key channel
    f = torch.randn(batch, steps, value_heads, dk, generator=g) * 0.5 + dt_bias
    gate = -5.0 * torch.sigmoid(f)
    beta = torch.sigmoid(torch.randn(batch, steps, value_heads, generator=g))
    inp = KDAInputs(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=gate, beta=beta)
    return inp.to(device)
