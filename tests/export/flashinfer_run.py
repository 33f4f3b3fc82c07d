"""Decode a recipe's calibration inputs through an exported FlashInfer allocation, and measure the recipe's metrics.

Used by the GPU test (the real kernels) and by a CPU test that puts FlashInfer's kernels re-computed in torch
(`ssmquant.engines.flashinfer`) behind the same exported arguments, which proves the driving loop, the ring
bookkeeping and the metrics on a machine without a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmquant.calibrate.settings import horizon_errors
from ssmquant.engines import flashinfer as fi
from ssmquant.kinds import expand_groups, mamba2_decays, mamba2_step
from ssmquant.replay.reference import reference_decode
from ssmquant.replay.trace import Trace, window_ends, window_statistics


def inv_softplus(dt: torch.Tensor) -> torch.Tensor:
    """dt_raw with softplus(dt_raw) = dt (float64 inside): the exported call applies softplus (dt_softplus=True)."""
    d = dt.double()
    return (d + torch.log(-torch.expm1(-d))).float()


def reset(ns) -> None:
    """Zero the exported state, ring and trackers; decode scales to 1."""
    ns["state"].zero_()
    if "state_scale" in ns["kwargs"]:
        ns["kwargs"]["state_scale"].fill_(1.0)
    if ns["REPLAY"]:
        for name in ("x_cache", "B_cache", "dt_cache", "ring_start", "prev_num_accepted_tokens"):
            ns[name].zero_()


def stored_state(ns, idx: torch.Tensor) -> torch.Tensor:
    """The stored state of slots `idx`, dequantized: [b, H, P, N] float32."""
    s = ns["state"][idx].float()
    if "state_scale" in ns["kwargs"]:
        s = s * ns["kwargs"]["state_scale"][idx][..., None]
    return s


def errors(trace: Trace) -> dict[str, float]:
    """{metric: value} of a one-variant trace over its horizon window (the recipe's definition)."""
    return {m: float(v[0]) for m, v in horizon_errors(trace).items()}


def kernel_trace(fn, ns, inputs, slots: list[int], record_every: int) -> Trace:
    """Decode `inputs` (Mamba2Inputs, batch = len(slots)) token by token: fn(**ns["kernel_args"](...)).

    fn: the kernel the export names; ns: the namespace of the executed flashinfer_alloc.py. Per step t (after
    token t): the output error is the kernel's output (in its dtype) against the FP32 reference output; the
    state error is the stored state against the FP32 reference state. Under replay that is what ssmquant's
    emulation measures: the last checkpoint, dequantized, advanced in float32 through the tokens since, and at
    a write step (the L-th token held) the checkpoint of those tokens itself. The kernel writes that
    checkpoint lazily, in the next call (which finds L tokens held), so the write step's state error is
    recorded from that call; after the last token one more call (zero inputs, output unused) writes the
    last checkpoint when one is due. The host advances ring_start / prev_num_accepted_tokens after each
    call: on a flush ring_start += the tokens held and the count restarts at the call's token, else the
    count grows by one (one token per call). Returns a Trace with one variant, "kernel".
    """
    dev = inputs.device
    bsz, steps, heads = inputs.batch, inputs.steps, inputs.num_heads
    y_ref, _, s_ref = reference_decode(inputs, return_states=True)  # [B, T, H, P], [B, T, H, P, N]
    a_dec = mamba2_decays(inputs)  # [B, T, H]
    bx = expand_groups(inputs.B.float(), heads)  # [B, T, H, N]
    dt_raw = inv_softplus(inputs.dt)
    A, D, dt_bias = inputs.A.float(), inputs.D.float(), torch.zeros(heads, device=dev)
    kslots = torch.tensor(slots, dtype=torch.int32, device=dev)  # what the kernel takes
    idx = torch.tensor(slots, dtype=torch.long, device=dev)  # for indexing here
    reset(ns)
    replay, L, ring = ns["REPLAY"], ns["BUFFER_LEN"], ns["RING"]
    per_step = torch.empty(steps, bsz, heads, 4, dtype=torch.float64, device=dev)
    s_adv = torch.zeros(bsz, heads, inputs.rows, inputs.state_dim, device=dev)

    def call(t: int) -> torch.Tensor:
        """One decode call with token t (t == steps: a zero token that only makes a due checkpoint be written)."""
        sl = slice(t, t + 1) if replay else t
        if t < steps:
            x, dtr = inputs.x[:, sl].contiguous(), dt_raw[:, sl].contiguous()
            B, C = inputs.B[:, sl].contiguous(), inputs.C[:, sl].contiguous()
        else:
            x, dtr = torch.zeros_like(inputs.x[:, -1:]), torch.zeros_like(dt_raw[:, -1:])
            B, C = torch.zeros_like(inputs.B[:, -1:]), torch.zeros_like(inputs.C[:, -1:])
        out = torch.empty_like(x)
        fn(**ns["kernel_args"](x, dtr, A, B, C, out, D, dt_bias, kslots))
        return out

    def state_err2(s: torch.Tensor, t: int) -> torch.Tensor:
        return ((s - s_ref[:, t]) ** 2).sum((-2, -1)).double()

    for t in range(steps + 1):
        if replay:
            held = ns["prev_num_accepted_tokens"][idx].clone()
            flush = bool((held + 1 > L).all())
            if t == steps and not flush:
                break
            out = call(t)
            if flush:  # the checkpoint now summarises tokens 0..t-1 (the write step t-1); token t went to the ring
                ns["ring_start"][idx] = (ns["ring_start"][idx] + held) % ring
                ns["prev_num_accepted_tokens"][idx] = 1
                s_adv = stored_state(ns, idx)
                per_step[t - 1, ..., 0] = state_err2(s_adv, t - 1)
            else:
                ns["prev_num_accepted_tokens"][idx] = held + 1
            if t == steps:
                break
            s_adv = mamba2_step(s_adv, a_dec[:, t], inputs.dt[:, t, :, None] * inputs.x[:, t].float(), bx[:, t])
            y = out[:, 0].float()
        else:
            if t == steps:
                break
            out = call(t)
            s_adv = stored_state(ns, idx)
            y = out.float()
        per_step[t, ..., 0] = state_err2(s_adv, t)
        per_step[t, ..., 1] = (s_ref[:, t] ** 2).sum((-2, -1)).double()
        per_step[t, ..., 2] = ((y - y_ref[:, t]) ** 2).sum(-1).double()
        per_step[t, ..., 3] = (y_ref[:, t] ** 2).sum(-1).double()
    stats = window_statistics(per_step, record_every)
    return Trace.from_windows(["kernel"], window_ends(steps, record_every), [stats], {"source": "exported kernel"})


def bf16_floor(inputs, record_every: int) -> float:
    """out_rel_err of the FP32 reference output rounded to bf16 over the horizon window: the output dtype's own
    share of every kernel output error."""
    y_ref, _, _ = reference_decode(inputs)
    e2 = ((y_ref.bfloat16().float() - y_ref) ** 2).sum(-1).transpose(0, 1)  # [T, B, H]
    r2 = (y_ref**2).sum(-1).transpose(0, 1)
    per_step = torch.stack([torch.zeros_like(e2), torch.ones_like(r2), e2, r2], -1).double()
    stats = window_statistics(per_step, record_every)
    tr = Trace.from_windows(["bf16"], window_ends(inputs.steps, record_every), [stats], {})
    return float(tr.rel_err("out")[0, tr.horizon_index])


class RecomputedKernels:
    """FlashInfer's Mamba-2 decode kernels re-computed in torch (`ssmquant.engines.flashinfer`), behind the
    exported keyword arguments: slots gathered, dt softplus'ed with its bias, the tie_hdim broadcasts undone.
    A stand-in for the real kernels where there is no GPU; stochastic rounding only for 8-bit state."""

    @staticmethod
    def _common(kw):
        dt = kw["dt"][..., 0]  # tie_hdim: one value per head
        if kw.get("dt_bias") is not None:
            dt = dt + kw["dt_bias"][:, 0]
        if kw.get("dt_softplus"):
            dt = F.softplus(dt)
        seed = kw.get("rand_seed")
        return dt, kw["A"][:, 0, 0], kw["D"][:, 0], None if seed is None else int(seed.item())

    def checkpointing_ssu(self, **kw):
        dt, A, D, seed = self._common(kw)
        idx = kw["state_batch_indices"].long()
        scale = kw.get("state_scale")
        names = ("state", "x_cache", "B_cache", "dt_cache", "ring_start", "prev_num_accepted_tokens")
        sub = {n: kw[n][idx].clone() for n in names}
        sub_scale = None if scale is None else scale[idx].clone()
        out = fi.checkpointing_ssu_reference(
            sub["state"], sub_scale, sub["x_cache"], sub["B_cache"], sub["dt_cache"], sub["ring_start"],
            sub["prev_num_accepted_tokens"], kw["x"], dt, A, kw["B"], kw["C"], D, rand_seed=seed,
        )  # fmt: skip
        for n in names[:4]:  # the kernel writes the state and the ring; the host owns the trackers
            kw[n][idx] = sub[n]
        if scale is not None:
            scale[idx] = sub_scale
        kw["out"].copy_(out)
        return kw["out"]

    def selective_state_update(self, **kw):
        dt, A, D, seed = self._common(kw)
        idx = kw["state_batch_indices"].long()
        state = kw["state"][idx].clone()
        out = fi.selective_state_update_reference(state, None, kw["x"], dt, A, kw["B"], kw["C"], D, rand_seed=seed)
        kw["state"][idx] = state
        kw["out"].copy_(out)
        return kw["out"]


def measure(fn, ns, recipe, slots: list[int]) -> dict:
    """The recipe's metrics on its calibration inputs, four ways: the recipe's own (ssmquant's emulation where it
    was calibrated), the same emulation re-run here, the `flashinfer` engine profile, and `fn` driven through the
    exported arguments (`kernel_trace`); plus the bf16 output floor. Runs on the device of ns["state"]."""
    from ssmquant.calibrate.settings import horizon_window
    from ssmquant.models.synthetic import synthetic_inputs
    from ssmquant.simulate import simulate

    from .flashinfer_recipes import BATCH, HORIZON, LAYER, MODEL, SEED

    entry = recipe.config["layers"][0]
    if entry["layer"] != LAYER or recipe.config["model"]["name"] != MODEL:
        raise ValueError(f"not a fixture recipe of {MODEL} layer {LAYER}: {recipe.path}")
    setting = recipe.layers[0].setting
    # the calibration data, regenerated as calibrate made it (CPU generator, seeded per layer), then moved
    inputs = synthetic_inputs(MODEL, LAYER, batch=BATCH, steps=HORIZON, seed=SEED, device="cpu")
    inputs = inputs.to(ns["state"].device)
    variant = setting.variant(seed=SEED)
    W = horizon_window([variant], HORIZON)
    ideal = errors(simulate(inputs, [variant], backend="torch", record_every=W))
    profile = errors(simulate(inputs, [variant], backend="torch", record_every=W, engine="flashinfer"))
    torch.manual_seed(SEED)  # the exported kernel_args draw their stochastic-rounding seeds from torch's RNG
    kernel = errors(kernel_trace(fn, ns, inputs, slots, W))
    return {
        "setting": setting.name,
        "kernel": ns["FUNCTION"],
        "recipe_emulation": entry["calibration_error"],
        "emulation_here": ideal,
        "flashinfer_profile": profile,
        "kernel_through_export": kernel,
        "bf16_output_floor": bf16_floor(inputs, W),
        "window_steps": W,
        "horizon": HORIZON,
    }


def summary_line(row: dict) -> str:
    r, k, p = row["recipe_emulation"], row["kernel_through_export"], row["flashinfer_profile"]
    return (
        f"{row['setting']} via {row['kernel']}: out_rel_err recipe {r['out_rel_err']:.4g} | emulation here "
        f"{row['emulation_here']['out_rel_err']:.4g} | flashinfer profile {p['out_rel_err']:.4g} | KERNEL "
        f"{k['out_rel_err']:.4g} (bf16 output floor {row['bf16_output_floor']:.4g}); state_rel_err recipe "
        f"{r['state_rel_err']:.4g} | profile {p['state_rel_err']:.4g} | KERNEL {k['state_rel_err']:.4g}"
    )
