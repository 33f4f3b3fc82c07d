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

Dynamics profiles (``profile=``; ``PROFILES``; labelled in ``meta["profile"]`` and in every report)
    ``init`` (the default) is the law above. The other profiles change it, on purpose, towards the
    properties that let rounding errors persist in trained models, which the isotropic init law lacks
    (its errors are forgotten within a few hundred steps):

    - ``slow-decay``: a share of the heads (chosen by the seed) gets a per-step decay near 1, a target
      half-life log-uniform in SLOW_HALF_LIFE (longer than any horizon we run): Mamba-2 through
      A_h = -ln 2 / (half_life * E[dt_h]) with E[dt_h] = softplus(dt_bias_h) * exp(sigma^2 / 2) (the
      exponential tail of softplus, as for the GDN offset above); GDN through the gate offset above;
    - ``low-rank-keys``: the keys (Mamba-2 B, GDN k) lie in a random subspace of rank ``key_rank`` of
      the state dim, up to a share ``key_leak`` of their energy; the queries (C, q) put a share
      ``query_leak`` of theirs outside it. The subspace is a parameter of the layer (one orthonormal
      basis per group / key head), and the projected vector keeps its expected squared norm. A delta rule
      only corrects the state along the keys it sees, so error outside a low-rank key subspace is never
      erased;
    - ``outliers``: heavy-tailed projections (Student-t with ``tail_df`` degrees of freedom, rescaled to
      the same variance) and a share ``outlier_row_fraction`` of the value channels (Mamba-2 x, GDN v:
      the rows of the state) amplified ``outlier_gain`` times (a parameter of the layer);
    - ``persistent``: all three together.

    These are synthetic stress profiles, not measurements of any trained checkpoint. They are defined
    for Mamba-2 and GDN presets; KDA presets take ``init`` only.

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
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .. import kinds
from .presets import GDNShape, KDAShape, Mamba2Shape, Preset, PresetError, get_preset
from .qk_norm import kda_l2norm, l2norm

_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Half-life range (steps) of the long-memory GDN heads (see the module docstring).
LONG_MEMORY_HALF_LIFE = (32.0, 4096.0)
# Half-life range (steps) of the slow-decay heads of the slow-decay / persistent profiles.
SLOW_HALF_LIFE = (16384.0, 131072.0)


@dataclass(frozen=True)
class SyntheticProfile:
    """A labelled change of the init law towards inputs whose rounding errors persist (module docstring).

    slow_decay_fraction: share of heads with a per-step decay near 1 (half-life in SLOW_HALF_LIFE);
    key_rank: rank of the key subspace (None: isotropic keys), capped at the state dim; key_leak /
    query_leak: share of the key / query energy outside it; tail_df: Student-t degrees of freedom of the
    projections (None: normal; an integer >= 3 so the variance is finite); outlier_row_fraction /
    outlier_gain: share of value channels amplified, and by how much.
    """

    name: str
    description: str
    slow_decay_fraction: float = 0.0
    key_rank: int | None = None
    key_leak: float = 0.0
    query_leak: float = 0.0
    tail_df: int | None = None
    outlier_row_fraction: float = 0.0
    outlier_gain: float = 1.0

    @property
    def is_init(self) -> bool:
        return self == PROFILES["init"]

    def to_dict(self) -> dict:
        return asdict(self)


_SLOW = dict(slow_decay_fraction=0.25)
_LOW_RANK = dict(key_rank=8, key_leak=0.02, query_leak=0.25)
_OUTLIERS = dict(tail_df=3, outlier_row_fraction=1 / 16, outlier_gain=20.0)
PROFILES: dict[str, SyntheticProfile] = {
    p.name: p
    for p in (
        SyntheticProfile("init", "the family's initialisation law (isotropic inputs, init decays)"),
        SyntheticProfile(
            "slow-decay",
            "stress profile: 1 in 4 heads with a per-step decay near 1 (half-life 16K-131K tokens)",
            **_SLOW,
        ),
        SyntheticProfile(
            "low-rank-keys",
            "stress profile: keys in a rank-8 subspace (2% leak), queries 25% outside it",
            **_LOW_RANK,
        ),
        SyntheticProfile(
            "outliers",
            "stress profile: Student-t(3) projections, 1 in 16 value channels 20x louder",
            **_OUTLIERS,
        ),
        SyntheticProfile(
            "persistent",
            "stress profile: slow-decay + low-rank-keys + outliers together",
            **_SLOW,
            **_LOW_RANK,
            **_OUTLIERS,
        ),
    )
}


def get_profile(profile: SyntheticProfile | str) -> SyntheticProfile:
    """A profile by name (or the profile itself); unknown names raise naming the accepted ones."""
    if isinstance(profile, SyntheticProfile):
        return profile
    try:
        return PROFILES[str(profile)]
    except KeyError:
        raise ValueError(f"unknown synthetic profile {profile!r}; accepted: {', '.join(PROFILES)}") from None


def _generator(seed: int, layer: int, device: torch.device, stream: int | None = None) -> torch.Generator:
    # SeedSequence mixes (seed, layer[, stream]) into independent, well-spread streams; stream 1 holds the
    # draws of a non-init profile, so the init law's stream (no stream entry) is the same under every profile.
    entropy = [int(seed), int(layer)] + ([] if stream is None else [int(stream)])
    state = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
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
    batch: int,
    steps: int,
    channels: int,
    shape,
    sigma: float,
    gen: torch.Generator,
    device,
    out_dtype,
    tail_df: int | None = None,
    tail_gen: torch.Generator | None = None,
) -> torch.Tensor:
    """Post-conv SiLU activations [B, T, C]; one sequence at a time keeps the fp32 peak small.

    tail_df: the projections are Student-t with that many degrees of freedom, scaled to variance sigma^2:
    the normal draw times sqrt((df - 2) / chi2_df), the chi-square from ``tail_gen`` (so that the normal
    draws, and everything else drawn from ``gen``, are those of the init law).
    """
    k = shape.conv_kernel
    # The conv weights are parameters of the layer: drawn once, shared by all sequences.
    bound = 1.0 / math.sqrt(k)
    w = (torch.rand(channels, 1, k, generator=gen, device=device) * 2 - 1) * bound
    bias = (torch.rand(channels, generator=gen, device=device) * 2 - 1) * bound if shape.use_conv_bias else None
    out = torch.empty(batch, steps, channels, device=device, dtype=out_dtype)
    for i in range(batch):
        pre = torch.randn(steps + k - 1, channels, generator=gen, device=device) * sigma
        if tail_df is not None:
            chi2 = torch.zeros_like(pre)
            for _ in range(tail_df):
                chi2 += torch.randn(pre.shape, generator=tail_gen, device=device) ** 2
            pre *= torch.sqrt((tail_df - 2) / chi2)
        conv = F.conv1d(pre.t().unsqueeze(0), w, bias, groups=channels)[0].t()  # [T, C]
        out[i] = F.silu(conv).to(out_dtype)
    return out


def _subspace_mix(x: torch.Tensor, basis: torch.Tensor, leak: float) -> torch.Tensor:
    """x [..., G, N] (fp32) -> the same vectors with a share `leak` of their energy outside span(basis).

    basis: [G, N, r] orthonormal columns per group. With P the projector on the span, the result is
    alpha P x + beta (I - P) x, alpha^2 r / N + beta^2 (N - r) / N = 1, so an isotropic x keeps its
    expected squared norm and puts exactly `leak` of it outside the span.
    """
    n, r = basis.shape[-2], basis.shape[-1]
    inside = torch.einsum("gnr,...gn->...gr", basis, x)
    inside = torch.einsum("gnr,...gr->...gn", basis, inside)
    outside = x - inside
    alpha = math.sqrt((1.0 - leak) * n / r)
    beta = math.sqrt(leak * n / (n - r)) if r < n else 0.0
    return alpha * inside + beta * outside


def _bases(groups: int, n: int, rank: int, gen: torch.Generator, device) -> torch.Tensor:
    """Random orthonormal bases [G, N, r] (QR of a Gaussian matrix, signs fixed by R's diagonal)."""
    q, r = torch.linalg.qr(torch.randn(groups, n, rank, generator=gen, device=device))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def _outlier_rows(heads: int, rows: int, profile: SyntheticProfile, gen: torch.Generator, device) -> torch.Tensor:
    """Per (head, row) gains [H, rows]: `outlier_gain` on a share `outlier_row_fraction` of the rows, else 1."""
    gain = torch.ones(heads * rows, device=device)
    n = int(round(profile.outlier_row_fraction * heads * rows))
    if n:
        gain[torch.randperm(heads * rows, generator=gen, device=device)[:n]] = profile.outlier_gain
    return gain.view(heads, rows)


def _slow_heads(heads: int, profile: SyntheticProfile, gen: torch.Generator, device):
    """(head indices, target half-lives) of the slow-decay heads, drawn from the profile's stream."""
    n = int(round(profile.slow_decay_fraction * heads))
    if not n:
        return [], torch.empty(0, device=device)
    idx = torch.randperm(heads, generator=gen, device=device)[:n].sort().values
    lo, hi = (math.log(v) for v in SLOW_HALF_LIFE)
    return idx.tolist(), torch.exp(lo + (hi - lo) * torch.rand(n, generator=gen, device=device))


def _mamba2(preset: Preset, shape: Mamba2Shape, batch, steps, gen, device, dtype, sigma, profile, pgen, options) -> dict:
    h, p, n, g = shape.num_heads, shape.head_dim, shape.state_size, shape.n_groups
    a = -torch.arange(1, h + 1, device=device, dtype=torch.float32)  # -exp(log(arange(1, H+1)))
    d = torch.ones(h, device=device, dtype=torch.float32)
    lo, hi = math.log(shape.time_step_min), math.log(shape.time_step_max)
    dt0 = torch.exp(torch.rand(h, generator=gen, device=device) * (hi - lo) + lo).clamp(min=shape.time_step_floor)
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus
    conv_dtype = dtype if profile.is_init else torch.float32  # a stress profile changes x, B, C before the cast
    xbc = _post_conv(batch, steps, h * p + 2 * g * n, shape, sigma, gen, device, conv_dtype, profile.tail_df, pgen)
    x, bm, cm = torch.split(xbc, [h * p, g * n, g * n], dim=-1)
    dt_raw = torch.randn(batch, steps, h, generator=gen, device=device) * sigma
    dt = F.softplus(dt_raw + dt_bias).clamp(min=shape.dt_limit[0], max=shape.dt_limit[1])
    x, bm, cm = x.reshape(batch, steps, h, p), bm.reshape(batch, steps, g, n), cm.reshape(batch, steps, g, n)
    extra = {}
    if not profile.is_init:
        # Profile draws come from their own stream, after the init law's: the init part stays identical.
        slow, half_life = _slow_heads(h, profile, pgen, device)
        if slow:
            mean_dt = dt0[slow] * math.exp(sigma**2 / 2)  # softplus's exponential tail
            a[slow] = -math.log(2.0) / (half_life * mean_dt)
        if profile.key_rank is not None:
            basis = _bases(g, n, min(profile.key_rank, n), pgen, device)
            bm = _subspace_mix(bm, basis, profile.key_leak)
            cm = _subspace_mix(cm, basis, profile.query_leak)
        gain = _outlier_rows(h, p, profile, pgen, device)
        x = x * gain
        x, bm, cm = x.to(dtype), bm.to(dtype), cm.to(dtype)
        extra = {"slow_decay_heads": slow, "outlier_rows": int((gain != 1).sum())}
    return dict(
        x=x,
        dt=dt,
        B=bm,
        C=cm,
        A=a,
        D=d,
        params={"dt_bias": dt_bias.cpu(), "A_log": torch.log(-a).cpu(), **extra},
    )


def _gdn(preset: Preset, shape: GDNShape, batch, steps, gen, device, dtype, sigma, profile, pgen, options) -> dict:
    long_frac = float(options["long_memory_fraction"])
    hv, hk, dk, dv = shape.num_value_heads, shape.num_key_heads, shape.key_head_dim, shape.value_head_dim
    # Stratified U(low, high): head h gets one draw from its own 1/Hv band of the init range.
    bands = torch.randperm(hv, generator=gen, device=device).float()
    u = (bands + torch.rand(hv, generator=gen, device=device)) / hv
    a_param = shape.a_init_low + (shape.a_init_high - shape.a_init_low) * u  # A = exp(A_log)
    dt_bias = torch.full((hv,), shape.dt_bias_init_value, device=device)
    n_long = int(round(long_frac * hv))
    offset = torch.zeros(hv, device=device)
    long_heads: list[int] = []

    def gate_offset(heads, half_life):
        # the constant offset of `a` that gives these heads the target mean half-life (module docstring)
        target = math.log(2.0) / (half_life * a_param[heads])  # wanted mean softplus(a + dt_bias)
        return torch.log(target) - dt_bias[heads] - sigma**2 / 2

    if n_long:
        heads = torch.randperm(hv, generator=gen, device=device)[:n_long]
        lo, hi = (math.log(v) for v in LONG_MEMORY_HALF_LIFE)
        half_life = torch.exp(lo + (hi - lo) * torch.rand(n_long, generator=gen, device=device))
        offset[heads] = gate_offset(heads, half_life)
        long_heads = sorted(int(i) for i in heads)
    qkv = _post_conv(
        batch, steps, 2 * hk * dk + hv * dv, shape, sigma, gen, device, torch.float32, profile.tail_df, pgen
    )
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = q.reshape(batch, steps, hk, dk), k.reshape(batch, steps, hk, dk)
    v = v.reshape(batch, steps, hv, dv)
    extra = {}
    if not profile.is_init:
        # Profile draws come from their own stream; the gate noise below stays the init law's draw.
        slow, half_life = _slow_heads(hv, profile, pgen, device)
        if slow:
            offset[slow] = gate_offset(torch.tensor(slow, device=device), half_life)
        if profile.key_rank is not None:
            basis = _bases(hk, dk, min(profile.key_rank, dk), pgen, device)
            k = _subspace_mix(k, basis, profile.key_leak)
            q = _subspace_mix(q, basis, profile.query_leak)
        gain = _outlier_rows(hv, dv, profile, pgen, device)
        v = v * gain
        extra = {"slow_decay_heads": slow, "outlier_rows": int((gain != 1).sum())}
    q = l2norm(q) * dk**-0.5
    k = l2norm(k)
    a_in = torch.randn(batch, steps, hv, generator=gen, device=device) * sigma + offset
    g = -a_param * F.softplus(a_in + dt_bias)
    b_in = torch.randn(batch, steps, hv, generator=gen, device=device) * sigma
    beta = torch.sigmoid(b_in.to(dtype))  # the model applies sigmoid to b in the activation dtype
    return dict(
        q=q,
        k=k,
        v=v.to(dtype),
        g=g,
        beta=beta,
        params={
            "A_log": torch.log(a_param).cpu(),
            "dt_bias": dt_bias.cpu(),
            "long_memory_heads": long_heads,
            **extra,
        },
    )


def _kda(preset: Preset, shape: KDAShape, batch, steps, gen, device, dtype, sigma, profile, pgen, options) -> dict:
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
    q = kda_l2norm(q.reshape(batch, steps, h, d)) * d**-0.5
    k = kda_l2norm(k.reshape(batch, steps, h, d))
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
    profile: SyntheticProfile | str = "init",
) -> kinds.LayerInputs:
    """Synthetic decode inputs of SSM layer ``layer`` (a decoder-layer index) of ``preset``.

    Shapes (B = batch, T = steps):
    - Mamba-2: x [B, T, H, P], dt [B, T, H], B/C [B, T, G, N], A [H], D [H]
    - GDN:     q/k [B, T, Hk, Dk], v [B, T, Hv, Dv], g/beta [B, T, Hv]
    - KDA:     q/k [B, T, H, Dk], v [B, T, H, Dv], g [B, T, H, Dk], beta [B, T, H]
    Distributions follow the family's initialisation (module docstring, README). ``dtype`` is the
    activation dtype (x, B, C, v, beta); dt, q, k, g, A, D are fp32. ``long_memory_fraction`` (GDN
    only; KDA's init already spans short and long channels) is the share of value heads given a
    nearly-closed gate. ``profile``: a name in PROFILES (or a SyntheticProfile); "init" is the init law,
    the others are labelled stress profiles (module docstring; Mamba-2 and GDN presets) that change the
    decays, keys and value rows and keep every other draw of the init law. Seeded per (seed, layer).
    ``meta["source"]`` is always "synthetic", ``meta["profile"]`` the profile's name and
    ``meta["distribution"]`` says whether it is the init law; ``meta["params"]`` holds the drawn A_log /
    dt_bias (and, for a stress profile, its slow-decay heads and the number of outlier rows).
    """
    preset = get_preset(preset)
    device = torch.device(device)
    _check_args(preset, layer, batch, steps, dtype)
    if not 0.0 <= float(long_memory_fraction) <= 1.0:
        raise ValueError(f"long_memory_fraction must lie in [0, 1], got {long_memory_fraction}")
    profile = get_profile(profile)
    gen = _generator(seed, layer, device)
    pgen = None if profile.is_init else _generator(seed, layer, device, stream=1)
    sigma = preset.initializer_range * math.sqrt(preset.hidden_size)
    meta = {
        "source": "synthetic",
        "model": preset.name,
        "hf_repo": preset.hf_repo,
        "layer": int(layer),
        "seed": int(seed),
        "distribution": "family-init" if profile.is_init else f"family-init + {profile.name} stress profile",
        "profile": profile.name,
        "activation_dtype": str(dtype).replace("torch.", ""),
    }
    if not profile.is_init:
        meta["profile_settings"] = profile.to_dict()
    draw = _DRAWS.get(preset.layer_kind)
    if draw is None:
        raise PresetError(f"preset {preset.name}: no synthetic draw is registered for {preset.layer_kind!r} layers")
    if not profile.is_init and not draw.stress_profiles:
        raise ValueError(f"synthetic profile {profile.name!r} {profiles_refusal(preset)}: use profile 'init'")
    options = {"long_memory_fraction": float(long_memory_fraction)}
    with torch.no_grad():
        t = draw.draw(preset, preset.shape, batch, steps, gen, device, dtype, sigma, profile, pgen, options)
        meta["params"] = t.pop("params")
        meta.update(draw.meta(preset, options))
        return kinds.get(preset.layer_kind).inputs_type(**t, meta=meta).validate()


@dataclass(frozen=True)
class SyntheticDraw:
    """How the synthetic inputs of one layer kind are drawn from its family's initialisation law.

    draw(preset, shape, batch, steps, gen, device, dtype, sigma, profile, pgen, options) -> the inputs' fields plus
    "params" (the drawn layer parameters, recorded in meta); meta(preset, options) -> what else meta records;
    stress_profiles: whether the labelled stress profiles (PROFILES other than "init") are defined for the kind."""

    draw: Callable
    stress_profiles: bool
    meta: Callable = lambda preset, options: {}


_DRAWS: dict[str, SyntheticDraw] = {}


def supports_profiles(kind: str) -> bool:
    """Whether the stress profiles are defined for presets of the layer kind named ``kind``."""
    return kind in _DRAWS and _DRAWS[kind].stress_profiles


def profiles_refusal(preset: Preset) -> str:
    """'is defined for Mamba-2 and GDN presets; X is a KDA preset': why a stress profile does not apply."""
    with_profiles = " and ".join(kinds.get(k).short for k, d in _DRAWS.items() if d.stress_profiles)
    return f"is defined for {with_profiles} presets; {preset.name} is a {kinds.get(preset.layer_kind).short} preset"


def register_draw(kind: str, draw: SyntheticDraw) -> SyntheticDraw:
    """Make ``synthetic_inputs`` draw presets of the layer kind named ``kind`` with ``draw``."""
    _DRAWS[kind] = draw
    return draw


def _kda_meta(preset, options) -> dict:
    lb = preset.shape.gate_lower_bound
    return {"gate": f"{lb:g} * sigmoid(exp(A_log) * (f + dt_bias))" if lb is not None else "-exp(A_log) * softplus(f + dt_bias)"}


register_draw("mamba2", SyntheticDraw(_mamba2, stress_profiles=True))
register_draw("gdn", SyntheticDraw(_gdn, True, lambda preset, options: {"long_memory_fraction": options["long_memory_fraction"]}))
register_draw("kda", SyntheticDraw(_kda, stress_profiles=False, meta=_kda_meta))


def synthetic_layers(
    preset: Preset | str, *, batch: int, steps: int, seed: int = 0, layers: list[int] | None = None, **kwargs
):
    """Yield (layer_idx, inputs) for every SSM layer of ``preset`` (or ``layers``), one at a time.

    Keyword arguments are those of ``synthetic_inputs``; only one layer is alive at a time.
    """
    preset = get_preset(preset)
    for layer in preset.ssm_layers if layers is None else layers:
        yield layer, synthetic_inputs(preset, layer, batch=batch, steps=steps, seed=seed, **kwargs)
