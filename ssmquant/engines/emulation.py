"""Engine profiles in the torch reference: one step of a Mamba-2 variant, for `replay.naive`'s loop.

`engine_step(runner, i)` is what `simulate` hands the loop: the step object of variant i under its engine profile,
or None where the profile computes the ideal arithmetic.

`Mamba2SSUStep` is the vllm / trtllm profiles' conventional step (`ssmquant.engines.triton_ssu`).

`Mamba2EngineStep` replaces the ideal state-form step of one variant (`naive.Emulation`). Its
arithmetic is that of `ssmquant.engines.flashinfer` (the kernels re-computed call by call), with the
coefficients precomputed once (`profiles.flashinfer_tables`) and the replay sums taken over the ring in
order, exactly as the Triton kernel (`ssmquant.kernels.mamba2_engine`) takes them.
"""

from __future__ import annotations

import torch

from ..formats import Encoding, Rounding
from ..kinds.mamba2 import mamba2_output, mamba2_step
from ..replay.schemes import SchemeKind
from . import philox
from .flashinfer import bf16, encode_rows, encode_rows_fast, replay_8bit, replay_wide
from .profiles import arithmetic, flashinfer_tables
from .triton_ssu import ssu_decays, ssu_update

_STORE_DTYPE = {Encoding.INT8: torch.int8, Encoding.FP8_E4M3: torch.float8_e4m3fn, Encoding.INT16: torch.int16}


class Mamba2EngineStep:
    """FlashInfer's decode of one variant over the runner's inputs (conventional or replay, one token per call).

    runner: the naive emulation (``replay.naive.Emulation``: inputs, the kind's physics, buffered inputs, write
    masks, the variant's StateStore);
    i: the variant's index. `step(t)` returns (the state the metrics see [B, H, P, N], y [B, H, P]).
    """

    def __init__(self, runner, i: int):
        v = runner.variants[i]
        self.fmt, self.seed = v.format, v.seed
        self.replay = v.scheme.kind is SchemeKind.REPLAY
        self.r, self.i = runner, i
        self.mask = runner.masks[i]  # [B, T]
        self.s = runner.s0_stored[i].clone()  # the state the metrics see: the initial state as stored
        enc = self.fmt.encoding
        self.eight = enc in (Encoding.INT8, Encoding.FP8_E4M3)
        self.sr = self.fmt.rounding is Rounding.SR
        if self.replay:
            inp = runner.inputs
            self.tab = flashinfer_tables(inp, self.mask, v.scheme.buffer_len)
            self.L = v.scheme.buffer_len
            # the checkpoint: code values and per-row decode scales (8-bit), or the stored values
            if self.eight:  # the engine's own encoding of the initial state, as its first checkpoint
                self.codes, self.dec = encode_rows_fast(runner.s0, _STORE_DTYPE[enc])
                self.s = self.codes * self.dec[..., None]
            else:
                self.codes, self.dec = self.s.clone(), None  # the stored initial state
            self.pending = torch.zeros(inp.batch, inp.num_heads, inp.rows, device=inp.device)

    # -- stores ---------------------------------------------------------------------------------------
    def _store_wide(self, s: torch.Tensor, t: int) -> torch.Tensor:
        """fp32 / bf16 / fp16 (RNE, or the profile's fp16 SR) / int16 store of s, as FP32 values."""
        enc = self.fmt.encoding
        if self.sr and enc is Encoding.FP16 and not self.replay:
            words = philox.ssu_fp16_words(philox.engine_seed(self.seed, t), tuple(s.shape), philox.PHILOX_ROUNDS, s.device)
            return philox.sr_fp16(s, words)
        if enc is Encoding.INT16:
            codes, dec = encode_rows(s, torch.int16)
            return codes * dec[..., None]
        # fp16 SR under replay: the kernel's stream is not reproduced; ssmquant's own (statistically equal)
        return self.r.stores[self.i](s, self.r.stores[self.i].key(t))

    def _encode_8bit(self, s: torch.Tensor, call: int):
        chunk = None
        if self.sr:
            chunk = philox.checkpoint_8bit_words(philox.engine_seed(self.seed, call), tuple(s.shape), philox.PHILOX_ROUNDS, s.device)
        return encode_rows_fast(s, _STORE_DTYPE[self.fmt.encoding], chunk)

    # -- one step --------------------------------------------------------------------------------------
    def step(self, t: int):
        p, (xb_all, bb_all) = self.r.physics, self.r.buffered[self.i]
        a, dt, x, xb, bb, c, d = p.a[:, t], p.dt[:, t], p.x[:, t], xb_all[:, t], bb_all[:, t], p.c[:, t], p.d
        write = self.mask[:, t]
        if not self.replay:
            s = mamba2_step(self.s, a, dt[..., None] * xb, bb)
            y = mamba2_output(s, c, d, x)
            if bool(write.any()):
                s = torch.where(write[:, None, None, None], self._store_wide(s, t), s)
            self.s = s
            return s, y
        y = self._replay_output(t, x, xb, c, d)
        self.s = mamba2_step(self.s, a, dt[..., None] * xb, bb)
        if bool(write.any()):
            self._flush(t, write)
        return self.s, y

    def _replay_output(self, t, x, xb, c, d):
        tab, bsz = self.tab, x.shape[0]
        fac, cbn = tab.fac[:, t], tab.cb_new[:, t]  # [B, H]
        if self.eight:
            raw = (self.codes * c[:, :, None, :]).sum(-1)  # [B, H, P]
            y_state = raw * (fac[..., None] * self.dec)
        else:
            y_state = (bf16(self.codes) * c[:, :, None, :]).sum(-1) * fac[..., None]
        y_nw = y_state + cbn[..., None] * xb
        ar = torch.arange(bsz, device=x.device)
        for j in range(self.L):  # the ring, oldest first
            step = (tab.start[:, t] + j).clamp(max=self.r.inputs.steps - 1)
            y_nw = y_nw + tab.cb_old[:, t, :, j, None] * self.r.buffered[self.i][0][ar, step]
        y_fl = fac[..., None] * self.pending + cbn[..., None] * xb
        y = torch.where(tab.flush_call[:, t, None, None], y_fl, y_nw)
        return y + d[None, :, None] * x

    def _flush(self, t: int, write: torch.Tensor) -> None:
        """The replay of the ring (steps start .. t) into the checkpoint, for the rows that write after step t."""
        tab, r = self.tab, self.r
        bsz = write.shape[0]
        ar = torch.arange(bsz, device=write.device)
        start = self._ring_start(t)
        steps = (start[:, None] + torch.arange(self.L, device=write.device)).clamp(max=r.inputs.steps - 1)
        xb_all, bb_all = r.buffered[self.i]
        xs = xb_all[ar[:, None], steps].permute(0, 2, 1, 3)  # [B, H, L, P]
        bs = bb_all[ar[:, None], steps].permute(0, 2, 1, 3)  # [B, H, L, N]
        coef, td = tab.coef[:, t], tab.total_decay[:, t]  # [B, H, L], [B, H]
        if self.eight:
            rep = replay_8bit(self.codes, self.dec, td, xs, coef, bs)
            codes, dec = self._encode_8bit(rep, t + 1)
            stored = codes * dec[..., None]
            self.codes = torch.where(write[:, None, None, None], codes, self.codes)
            self.dec = torch.where(write[:, None, None], dec, self.dec)
            out_state = rep
        else:
            rep = replay_wide(self.codes, td, xs, coef, bs)
            stored = self._store_wide(rep, t)
            self.codes = torch.where(write[:, None, None, None], stored, self.codes)
            out_state = stored
        if t + 1 < r.inputs.steps:
            c_next = r.physics.c[:, t + 1]
            pend = (bf16(out_state) * c_next[:, :, None, :]).sum(-1)
            self.pending = torch.where(write[:, None, None], pend, self.pending)
        self.s = torch.where(write[:, None, None, None], stored, self.s)

    def _ring_start(self, t: int) -> torch.Tensor:
        """First ring step of the flush after step t: the start of call t + 1 (that of call t unless t flushed)."""
        st = self.tab.start[:, t]
        return torch.where(self.tab.flush_call[:, t], torch.full_like(st, t), st)



class Mamba2SSUStep:
    """vLLM's / TensorRT-LLM's Triton `selective_state_update` on one variant (conventional decode).

    The decays are the engine's bits (`triton_ssu.ssu_decays`, computed once), the update is
    fma(S, dA, fp32(dt B) x) and the output sum(S C) + D x from the FP32 state before the store; the store
    is the variant's own (round to nearest, or ssmquant's SR stream for fp16:sr). `step(t)` returns
    (the state the metrics see [B, H, P, N], y [B, H, P]); the Triton twin is `kernels.mamba2_engine` (SSU).
    """

    def __init__(self, runner, i: int):
        v = runner.variants[i]
        self.r, self.i = runner, i
        self.mask = runner.masks[i]  # [B, T]
        self.s = runner.s0_stored[i].clone()
        self.da = ssu_decays(runner.inputs.A, runner.inputs.dt, v.engine)  # [B, T, H]

    def step(self, t: int):
        r, p = self.r, self.r.physics
        xb, bb = r.buffered[self.i]
        s = ssu_update(self.s, self.da[:, t], p.dt[:, t], xb[:, t], bb[:, t])
        y = mamba2_output(s, p.c[:, t], p.d, p.x[:, t])
        write = self.mask[:, t]
        if bool(write.any()):
            store = r.stores[self.i]
            s = torch.where(write[:, None, None, None], store(s, store.key(t)), s)
        self.s = s
        return s, y


def engine_step(runner, i: int):
    """The step object of the runner's variant i under its engine profile, None for the ideal arithmetic."""
    kind = arithmetic(runner.variants[i].engine, runner.inputs.kind)
    if kind == "ideal":
        return None
    return Mamba2SSUStep(runner, i) if kind == "triton_ssu" else Mamba2EngineStep(runner, i)
