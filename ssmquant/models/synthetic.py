"""Shape-exact synthetic decode inputs for any preset, drawn as the model family initialises its layers.

No weights are needed. The distributions (documented in full in ``ssmquant/models/README.md``):

Shared by both families
    Pre-activation projections (the in_proj outputs) are i.i.d. N(0, sigma^2) with
    sigma = initializer_range * sqrt(hidden_size): the output scale of a freshly initialised linear
    layer (weights N(0, initializer_range^2)) applied to an RMS-normalised hidden state. The conv
    inputs then pass through the mixer's depthwise causal conv (weights, and bias where the family has
    one, U(-1/sqrt(K), 1/sqrt(K)): PyTorch's Conv1d init, fan-in K) and SiLU, as the mixer does, so
    consecutive steps are correlated the way post-conv activations are. The conv runs over K - 1 steps
    of history drawn from the same law (a steady state, not the zero-padded start of a prompt).

Mamba-2 (NemotronH init)
    A = -exp(A_log), A_log = log(arange(1, H + 1)), so A_h = -(h + 1); D = 1;
    dt_bias = softplus^-1(dt0), dt0 = clamp(exp(U(log time_step_min, log time_step_max)), time_step_floor);
    dt = clamp(softplus(dt_raw + dt_bias), dt_limit) with dt_raw the projection above. Per-step decays
    exp(dt * A) therefore span exp(-H * 0.1) (short) to exp(-0.001) (long-memory heads).

Gated DeltaNet (Qwen3.5 / Qwen3-Next init)
    A = exp(A_log) ~ U(0.01, 16) -- drawn stratified across the Hv heads (one draw per 1/Hv quantile
    band, bands shuffled) so every draw covers the whole init range; dt_bias = 1;
    g = -A * softplus(a + dt_bias), beta = sigmoid(b), a and b the projections above.
    The init alone has almost no long-memory GDN heads (A >= 0.01 and softplus(a + 1) ~ 1 give
    half-lives of at most ~50 steps, most heads decay within a few steps), while trained models gate
    many heads nearly shut. To give realistic spread, a fraction ``long_memory_fraction`` of the heads
    (chosen by the seed) gets a target half-life drawn log-uniform in LONG_MEMORY_HALF_LIFE steps and a
    constant gate offset mu_h added to a such that the mean per-step decay has that half-life:
    mu_h = log(t_h) - dt_bias - sigma^2 / 2 with t_h = ln 2 / (half_life * A_h) (the sigma^2 / 2 undoes
    the mean of exp(sigma * z) in softplus's exponential tail). Set ``long_memory_fraction=0`` for the
    pure init law.
    q, k = l2norm(conv-SiLU output) (eps 1e-6, as transformers / FLA), q scaled by 1/sqrt(Dk);
    v = the conv-SiLU output (the model's own v; not a plain normal).

Kimi Delta Attention (GLM-5.3-Flash / Kimi-Linear init, transformers' Glm5Next / KimiLinear _init_weights)
    q, k, v = the conv-SiLU outputs (conv without bias), q and k L2-normalised as transformers' KDA
    l2norm does (x / sqrt(sum x^2 + 1e-6)), q scaled by 1/sqrt(Dk). The forget gate is a low-rank pair
    f = f_b(f_a(h)) (hidden -> head_dim -> H * Dk): with both weights N(0, initializer_range^2) its
    pre-activation is N(0, sigma_f^2), sigma_f = initializer_range * sqrt(head_dim) * sigma. dt_bias, one
    per key channel, is softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1] (floored at 1e-4).
    GLM-5.3-Flash (gate_lower_bound -5): A_log = 0, g = -5 * sigmoid(f + dt_bias); Kimi-Linear:
    A = exp(A_log) ~ U(1, 16) (stratified across heads, as for GDN), g = -A * softplus(f + dt_bias).
    So every head mixes key channels with half-lives from about one step to a few hundred steps;
    ``long_memory_fraction`` does not apply (it shapes GDN's per-head gates only). beta = sigmoid(b),
    b ~ N(0, sigma^2), in the activation dtype.

Dtypes follow what a model hands to its recurrence kernel: x, B, C (Mamba-2) and v, beta (GDN) in
``dtype`` (the activation dtype, bf16 by default); dt after softplus and clamp, q and k after the L2
norm, g (both kinds), and A, D in fp32, because the kernels (mamba_ssm, FLA, vLLM, transformers' torch path for GDN)
derive those in fp32 from the activations.

Seeding: one generator per (seed, layer), so every layer is reproducible on its own and two layers
never share random numbers. Draws are made on ``device``: the same (seed, layer) gives the same numbers
on the same device type (CPU and CUDA generators differ).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..replay.inputs import GDNInputs, KDAInputs, Mamba2Inputs
from .presets import GDNShape, KDAShape, Mamba2Shape, Preset, PresetError, get_preset

_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Half-life range (steps) of the long-memory GDN heads (see the module docstring).
LONG_MEMORY_HALF_LIFE = (32.0, 4096.0)
L2NORM_EPS = 1e-6


def _generator(seed: int, layer: int, device: torch.device) -> torch.Generator:
    # SeedSequence mixes (seed, layer) into independent, well-spread streams.
    state = np.random.SeedSequence([int(seed), int(layer)]).generate_state(2, dtype=np.uint32)
    gen = torch.Generator(device=device)
    gen.manual_seed(int(state[0]) << 31 ^ int(state[1]))
    return gen


def _check_args(preset: Preset, layer: int, batch: int, steps: int, dtype: torch.dtype) -> None:
    for name, v in (("batch", batch), ("steps", steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"dtype must be one of torch.float32, torch.bfloat16, torch.float16; got {dtype}")
    preset.layer_position(layer)  # raises naming the SSM layers


def _post_conv(
    batch: int, steps: int, channels: int, shape, sigma: float, gen: torch.Generator, device, out_dtype
) -> torch.Tensor:
    """Post-conv SiLU activations [B, T, C]; one sequence at a time keeps the fp32 peak small."""
    k = shape.conv_kernel
    # The conv weights are parameters of the layer: drawn once, shared by all sequences.
    bound = 1.0 / math.sqrt(k)
    w = (torch.rand(channels, 1, k, generator=gen, device=device) * 2 - 1) * bound
    bias = (torch.rand(channels, generator=gen, device=device) * 2 - 1) * bound if shape.use_conv_bias else None
    out = torch.empty(batch, steps, channels, device=device, dtype=out_dtype)
    for i in range(batch):
        pre = torch.randn(steps + k - 1, channels, generator=gen, device=device) * sigma
        conv = F.conv1d(pre.t().unsqueeze(0), w, bias, groups=channels)[0].t()  # [T, C]
        out[i] = F.silu(conv).to(out_dtype)
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # Same formula as transformers' l2norm / FLA: x * rsqrt(sum(x^2) + eps), in fp32.
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _mamba2(preset: Preset, shape: Mamba2Shape, batch, steps, gen, device, dtype, sigma) -> dict:
    h, p, n, g = shape.num_heads, shape.head_dim, shape.state_size, shape.n_groups
    a = -torch.arange(1, h + 1, device=device, dtype=torch.float32)  # -exp(log(arange(1, H+1)))
    d = torch.ones(h, device=device, dtype=torch.float32)
    lo, hi = math.log(shape.time_step_min), math.log(shape.time_step_max)
    dt0 = torch.exp(torch.rand(h, generator=gen, device=device) * (hi - lo) + lo).clamp(min=shape.time_step_floor)
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus
    xbc = _post_conv(batch, steps, h * p + 2 * g * n, shape, sigma, gen, device, dtype)
    x, bm, cm = torch.split(xbc, [h * p, g * n, g * n], dim=-1)
    dt_raw = torch.randn(batch, steps, h, generator=gen, device=device) * sigma
    dt = F.softplus(dt_raw + dt_bias).clamp(min=shape.dt_limit[0], max=shape.dt_limit[1])
    return dict(
        x=x.reshape(batch, steps, h, p),
        dt=dt,
        B=bm.reshape(batch, steps, g, n),
        C=cm.reshape(batch, steps, g, n),
        A=a,
        D=d,
        params={"dt_bias": dt_bias.cpu(), "A_log": torch.log(-a).cpu()},
    )


def _gdn(preset: Preset, shape: GDNShape, batch, steps, gen, device, dtype, sigma, long_frac) -> dict:
    hv, hk, dk, dv = shape.num_value_heads, shape.num_key_heads, shape.key_head_dim, shape.value_head_dim
    # Stratified U(low, high): head h gets one draw from its own 1/Hv band of the init range.
    bands = torch.randperm(hv, generator=gen, device=device).float()
    u = (bands + torch.rand(hv, generator=gen, device=device)) / hv
    a_param = shape.a_init_low + (shape.a_init_high - shape.a_init_low) * u  # A = exp(A_log)
    dt_bias = torch.full((hv,), shape.dt_bias_init_value, device=device)
    n_long = int(round(long_frac * hv))
    offset = torch.zeros(hv, device=device)
    long_heads: list[int] = []
    if n_long:
        heads = torch.randperm(hv, generator=gen, device=device)[:n_long]
        lo, hi = (math.log(v) for v in LONG_MEMORY_HALF_LIFE)
        half_life = torch.exp(lo + (hi - lo) * torch.rand(n_long, generator=gen, device=device))
        target = math.log(2.0) / (half_life * a_param[heads])  # wanted mean softplus(a + dt_bias)
        offset[heads] = torch.log(target) - dt_bias[heads] - sigma**2 / 2
        long_heads = sorted(int(i) for i in heads)
    qkv = _post_conv(batch, steps, 2 * hk * dk + hv * dv, shape, sigma, gen, device, torch.float32)
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = _l2norm(q.reshape(batch, steps, hk, dk)) * dk**-0.5
    k = _l2norm(k.reshape(batch, steps, hk, dk))
    a_in = torch.randn(batch, steps, hv, generator=gen, device=device) * sigma + offset
    g = -a_param * F.softplus(a_in + dt_bias)
    b_in = torch.randn(batch, steps, hv, generator=gen, device=device) * sigma
    beta = torch.sigmoid(b_in.to(dtype))  # the model applies sigmoid to b in the activation dtype
    return dict(
        q=q,
        k=k,
        v=v.reshape(batch, steps, hv, dv).to(dtype),
        g=g,
        beta=beta,
        params={
            "A_log": torch.log(a_param).cpu(),
            "dt_bias": dt_bias.cpu(),
            "long_memory_heads": long_heads,
        },
    )


def _kda_l2norm(x: torch.Tensor) -> torch.Tensor:
    # transformers' KDA l2norm (models/glm5_next `l2norm`): x / sqrt(sum(x^2) + eps), in fp32
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _kda(preset: Preset, shape: KDAShape, batch, steps, gen, device, dtype, sigma) -> dict:
    h, d = shape.num_heads, shape.head_dim
    lo, hi = math.log(shape.time_step_min), math.log(shape.time_step_max)
    dt0 = torch.exp(torch.rand(h * d, generator=gen, device=device) * (hi - lo) + lo).clamp(min=shape.time_step_floor)
    dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).reshape(h, d)  # inverse softplus, per key channel
    if shape.gate_lower_bound is not None:
        a_param = torch.ones(h, device=device)  # exp(A_log), A_log = 0
    else:
        bands = torch.randperm(h, generator=gen, device=device).float()
        u = (bands + torch.rand(h, generator=gen, device=device)) / h
        a_param = shape.a_init_low + (shape.a_init_high - shape.a_init_low) * u
    qkv = _post_conv(batch, steps, 3 * h * d, shape, sigma, gen, device, torch.float32)
    q, k, v = torch.split(qkv, [h * d] * 3, dim=-1)
    q = _kda_l2norm(q.reshape(batch, steps, h, d)) * d**-0.5
    k = _kda_l2norm(k.reshape(batch, steps, h, d))
    sigma_f = preset.initializer_range * math.sqrt(d) * sigma  # f_b(f_a(h)), both N(0, initializer_range^2)
    f = torch.randn(batch, steps, h, d, generator=gen, device=device) * sigma_f + dt_bias
    if shape.gate_lower_bound is not None:
        g = shape.gate_lower_bound * torch.sigmoid(a_param[:, None] * f)
    else:
        g = -a_param[:, None] * F.softplus(f)
    b_in = torch.randn(batch, steps, h, generator=gen, device=device) * sigma
    return dict(
        q=q,
        k=k,
        v=v.reshape(batch, steps, h, d).to(dtype),
        g=g,
        beta=torch.sigmoid(b_in.to(dtype)),
        params={"A_log": torch.log(a_param).cpu(), "dt_bias": dt_bias.reshape(-1).cpu(), "gate_sigma": sigma_f},
    )


def synthetic_inputs(
    preset: Preset | str,
    layer: int,
    *,
    batch: int,
    steps: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    long_memory_fraction: float = 0.25,
) -> Mamba2Inputs | GDNInputs | KDAInputs:
    """Synthetic decode inputs of SSM layer ``layer`` (a decoder-layer index) of ``preset``.

    Shapes (B = batch, T = steps):
    - Mamba-2: x [B, T, H, P], dt [B, T, H], B/C [B, T, G, N], A [H], D [H]
    - GDN:     q/k [B, T, Hk, Dk], v [B, T, Hv, Dv], g/beta [B, T, Hv]
    - KDA:     q/k [B, T, H, Dk], v [B, T, H, Dv], g [B, T, H, Dk], beta [B, T, H]
    Distributions follow the family's initialisation (module docstring, README). ``dtype`` is the
    activation dtype (x, B, C, v, beta); dt, q, k, g, A, D are fp32. ``long_memory_fraction`` (GDN
    only; KDA's init already spans short and long channels) is the share of value heads given a
    nearly-closed gate. Seeded per (seed, layer).
    ``meta["source"]`` is always "synthetic"; ``meta["params"]`` holds the drawn A_log / dt_bias.
    """
    preset = get_preset(preset)
    device = torch.device(device)
    _check_args(preset, layer, batch, steps, dtype)
    if not 0.0 <= float(long_memory_fraction) <= 1.0:
        raise ValueError(f"long_memory_fraction must lie in [0, 1], got {long_memory_fraction}")
    gen = _generator(seed, layer, device)
    sigma = preset.initializer_range * math.sqrt(preset.hidden_size)
    meta = {
        "source": "synthetic",
        "model": preset.name,
        "hf_repo": preset.hf_repo,
        "layer": int(layer),
        "seed": int(seed),
        "distribution": "family-init",
        "activation_dtype": str(dtype).replace("torch.", ""),
    }
    with torch.no_grad():
        if isinstance(preset.shape, Mamba2Shape):
            t = _mamba2(preset, preset.shape, batch, steps, gen, device, dtype, sigma)
            meta["params"] = t.pop("params")
            return Mamba2Inputs(**t, meta=meta).validate()
        if isinstance(preset.shape, GDNShape):
            t = _gdn(preset, preset.shape, batch, steps, gen, device, dtype, sigma, float(long_memory_fraction))
            meta["params"] = t.pop("params")
            meta["long_memory_fraction"] = float(long_memory_fraction)
            return GDNInputs(**t, meta=meta).validate()
        if isinstance(preset.shape, KDAShape):
            t = _kda(preset, preset.shape, batch, steps, gen, device, dtype, sigma)
            meta["params"] = t.pop("params")
            meta["gate"] = (
                f"{preset.shape.gate_lower_bound:g} * sigmoid(exp(A_log) * (f + dt_bias))"
                if preset.shape.gate_lower_bound is not None
                else "-exp(A_log) * softplus(f + dt_bias)"
            )
            return KDAInputs(**t, meta=meta).validate()
    raise PresetError(f"preset {preset.name} has an unknown layer kind {preset.layer_kind!r}")


def synthetic_layers(
    preset: Preset | str, *, batch: int, steps: int, seed: int = 0, layers: list[int] | None = None, **kwargs
):
    """Yield (layer_idx, inputs) for every SSM layer of ``preset`` (or ``layers``), one at a time.

    Keyword arguments are those of ``synthetic_inputs``; only one layer is alive at a time.
    """
    preset = get_preset(preset)
    for layer in preset.ssm_layers if layers is None else layers:
        yield layer, synthetic_inputs(preset, layer, batch=batch, steps=steps, seed=seed, **kwargs)
