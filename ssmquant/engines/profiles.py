"""Engine profiles: what a serving kernel computes differently from the ideal recurrence, by name.

- `ideal`: the emulation as it always was: the state is advanced step by step in FP32, rounded to its
  format at write steps, and each output is computed from the FP32 state of its step.
- `flashinfer`: FlashInfer 0.7.2.post1's Mamba-2 decode kernels (`ssmquant.engines.flashinfer` has the
  arithmetic, with sources). Conventional decoding is `selective_state_update`: the ideal arithmetic,
  fp32 / bf16 / fp16 / scaled int16 state, stochastic rounding only for fp16, with the kernel's Philox
  stream and conversion. Replay is `checkpointing_ssu` with one token per call: the checkpoint is
  rewritten from the engine's replay (bf16 products of the ring inputs and their decay coefficients) and
  rounded per row as the kernel does (int8 / fp8_e4m3 need head_dim 64, d_state 128; their stochastic
  rounding uses the kernel's Philox stream); outputs come from the checkpoint and the ring through bf16
  coefficient matrices, and the output of the call that flushes comes from a bf16 copy of the replayed,
  not yet rounded, state. The state the metrics see between flushes is the stored checkpoint advanced
  in FP32 (what a replay of the ring in exact arithmetic would give).
- `vllm` (0.33.0) and `trtllm` (TensorRT-LLM main; decode kernel read at 1d2bb3b): Mamba-2 conventional
  decoding through their Triton `selective_state_update` (`ssmquant.engines.triton_ssu` has the arithmetic,
  with sources): the ideal recurrence except the decay's ex2.approx bits, the input term's order
  (dt B, then x) and one FMA rounding for a S + input; fp32 / bf16 / fp16 state stored to nearest. vLLM's
  fp16 stochastic rounding (cvt.rs, SM 10.x only) is emulated with ssmquant's own stream: statistically,
  not bitwise, equivalent. vLLM's GDN decode (`fused_recurrent_gated_delta_rule_packed_decode`,
  vllm/third_party/flash_linear_attention/ops/fused_recurrent.py @ 0.33.0: decay, delta, update, output
  in the ideal's order in fp32, the state stored in the cache dtype) runs on the ideal kernels: the `vllm`
  profile contributes only its constraints there (FMA contraction and the in-kernel l2norm / gate are
  not modelled, and no oracle ran that kernel here). Replay and speculative schemes are refused with
  the engines' own words (vLLM's FlashInfer ReplaySSM is the `flashinfer` profile).

- `sglang` (0.5.23): Mamba-2 on `--mamba-backend flashinfer` computes as the `flashinfer` profile (conventional only:
  SGLang has no Mamba-2 ReplaySSM); GDN / KDA on its Triton linear-attention decode (fla's fused recurrent
  kernels) as `ideal`, ReplaySSM with the ring in the state dtype, the speculative verify on a float32 state. The
  profile adds SGLang's own rules: float32 / bfloat16 / float16 live state, stochastic rounding for Mamba-2 float16
  only (FlashInfer's Philox stream; SGLang passes --mamba-cache-philox-rounds, whose default 0 means FlashInfer's 10).

Refused, with the engine's constraint: GDN / KDA layers (FlashInfer's `gdn_decode` is CuTe DSL and not
modelled; vLLM decodes them with fla's fused recurrent kernels, which the oracle finds equal to the ideal
recurrence), speculative schemes (`checkpointing_ssu` with several tokens per call runs in the oracle
only), and formats or shapes the kernels do not take.

Tables: everything the replay profile needs that depends only on the inputs and the flush schedule
(scans, decays, the bf16 coefficient matrices) is computed once in torch (`flashinfer_tables`) and
shared by the torch and Triton backends, so both apply bit-identical coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SsmquantError
from ..formats import Encoding, Rounding, ScaleMode, StateFormat
from ..replay.schemes import SchemeKind
from ..replay.variants import ENGINE_PROFILES
from .facts import FACTS
from .flashinfer import CKPT_8BIT_SHAPE, MAX_WINDOW, bf16, fast_expf, hs_scan

ENGINES = ENGINE_PROFILES  # the names a variant may give (replay.variants); each is implemented here
IDEAL = "ideal"
SSU_ENGINES = ("vllm", "trtllm")  # conventional Mamba-2 decode by a mamba_ssm-descended Triton kernel
SGLANG = "sglang"
# engines whose GDN / KDA decode is fla's fused recurrent arithmetic, the ideal recurrence in FP32
LINEAR_ON_IDEAL = ("vllm", SGLANG)


class EngineError(SsmquantError, ValueError):
    """A variant or layer that an engine profile cannot emulate (the engine's own constraint is quoted)."""


def check_engine(name: str) -> str:
    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}; accepted: {', '.join(ENGINES)}")
    return name


def arithmetic(engine: str, kind: str) -> str:
    """Which emulation computes `engine` on a `kind` layer: "ideal", "flashinfer" or "triton_ssu".

    Both backends dispatch on this: "ideal" variants share the ideal kernels (fused with other variants),
    the others run their engine step (`emulation.py`) / kernel (`kernels/mamba2_engine.py`).
    """
    if engine == IDEAL or (engine in LINEAR_ON_IDEAL and kind != "mamba2"):
        return "ideal"
    if engine == SGLANG:  # --mamba-backend flashinfer: FlashInfer's selective_state_update (fact sglang.mamba_backend)
        return "flashinfer"
    return "triton_ssu" if engine in SSU_ENGINES else engine


def _fact(fid: str, quote: bool = True, **values) -> str:
    """An export fact's quote (the engine's own words, its placeholders filled from ``values``) and citation; with
    quote False, or a fact without a quote, what the fact says instead (where the quote is not the rule at hand)."""
    f = FACTS[fid]
    if not f.quote or not quote:
        return f"{f.says} {f.cite()}"

    class _Keep(dict):
        def __missing__(self, key):  # a placeholder with no value stays as the engine writes it
            return "{" + key + "}"

    return f"\"{f.quote.format_map(_Keep(values))}\" {f.cite()}"


def _check_ssu(engine: str, fmt: StateFormat, scheme, kind: str) -> None:
    """The vllm / trtllm profiles' constraints (the engines' words quoted from `facts.py`)."""
    where = f"{fmt.name}@{scheme.name}~{engine}"
    enc, sr = fmt.encoding, fmt.rounding is Rounding.SR
    if engine == "trtllm" and kind != "mamba2":
        raise EngineError(f"{where}: the trtllm profile models TensorRT-LLM's Mamba-2 decode only; its {kind} decode kernel was not read")
    if enc not in (Encoding.FP32, Encoding.BF16, Encoding.FP16):
        fid = "vllm.state_dtype" if engine == "vllm" else "trtllm.state_dtype"
        raise EngineError(
            f"{where}: the SSM cache dtype is one of float32, bfloat16, float16: {_fact(fid, value=repr(enc.value))}"
        )
    if scheme.kind is SchemeKind.REPLAY:
        if engine == "trtllm":
            raise EngineError(f"{where}: without speculative decoding TensorRT-LLM stores the state every token: {_fact('trtllm.replay_spec_only')}; use a conventional scheme")
        if kind != "mamba2":
            raise EngineError(f"{where}: {_fact('vllm.replay_arch')}")
        raise EngineError(
            f"{where}: vLLM's ReplaySSM runs FlashInfer checkpointing_ssu with --mamba-backend flashinfer (use ~flashinfer); "
            "its Triton ReplaySSM kernel (selective_state_update_replayssm_output_only.py) is not modelled"
        )
    if scheme.kind is SchemeKind.SPEC:
        fid = "vllm.spec_fi" if engine == "vllm" else "trtllm.replay_gates"
        raise EngineError(f"{where}: speculative decoding is not modelled by the {engine} profile ({_fact(fid)})")
    if sr and engine == "trtllm":
        raise EngineError(
            f"{where}: TensorRT-LLM's selective_state_update (read at 1d2bb3b) stores the state with .to(dtype), to "
            "nearest; its stochastic rounding is not modelled"
        )
    if sr and enc is not Encoding.FP16:
        raise EngineError(f"{where}: {_fact('vllm.sr_fp16')}")
    if sr and kind != "mamba2":
        raise EngineError(f"{where}: {_fact('vllm.sr_mamba_only')}")


def _check_sglang(fmt: StateFormat, scheme, kind: str) -> None:
    """The sglang profile's constraints (SGLang's words quoted from `facts.py`): its live state dtypes, stochastic
    rounding for Mamba-2 float16 only, ReplaySSM for GDN / KDA only with the ring in the state dtype, and the
    speculative verify folding every commit into a float32 checkpoint."""
    where = f"{fmt.name}@{scheme.name}~sglang"
    enc, sr = fmt.encoding, fmt.rounding is Rounding.SR
    if fmt.scale_mode is ScaleMode.STATIC or enc not in (Encoding.FP32, Encoding.BF16, Encoding.FP16):
        raise EngineError(
            f"{where}: SGLang's live SSM state is float32, bfloat16 or float16 (--mamba-ssm-dtype; int8 only as "
            f"the prefix-cache checkpoint, a prompt store: +int8col): {_fact('sglang.state_dtype')}"
        )
    if sr and kind != "mamba2":
        raise EngineError(f"{where}: {_fact('sglang.sr_mamba_only')}")
    if sr and enc is not Encoding.FP16:
        raise EngineError(f"{where}: {_fact('sglang.sr', value=repr(enc.value))}")
    if kind == "mamba2":
        if scheme.kind is not SchemeKind.CONVENTIONAL:
            raise EngineError(
                f"{where}: SGLang decodes Mamba-2 layers conventionally: {_fact('sglang.linear_replayssm', False)}"
            )
        return
    if scheme.kind is SchemeKind.REPLAY and scheme.buffer_dtype != enc.value:
        raise EngineError(
            f"{where}: SGLang's ReplaySSM ring holds the inputs in the SSM dtype ({enc.value}), not "
            f"{scheme.buffer_dtype} (replay{scheme.buffer_len}:{enc.value}): {_fact('sglang.linear_replayssm', False)}"
        )
    if scheme.kind is SchemeKind.SPEC and enc is not Encoding.FP32:
        raise EngineError(f"{where}: use fp32 state: {_fact('sglang.linear_replayssm_spec', False)}")


def check_variant(engine: str, fmt: StateFormat, scheme, kind: str, state_shape: tuple[int, ...]) -> None:
    """Raise EngineError when `engine` cannot run `fmt` under `scheme` on a `kind` layer of `state_shape`."""
    check_engine(engine)
    if engine == IDEAL:
        return
    if engine == SGLANG:
        _check_sglang(fmt, scheme, kind)
        if kind == "mamba2":  # the flashinfer profile's own constraints on what remains
            _check_flashinfer(fmt, scheme, kind, state_shape)
        return
    if engine in SSU_ENGINES:
        if fmt.scale_mode is ScaleMode.STATIC:
            raise EngineError(f"{fmt.name}@{scheme.name}~{engine}: the engine stores float state, no static scales")
        _check_ssu(engine, fmt, scheme, kind)
        return
    _check_flashinfer(fmt, scheme, kind, state_shape)


def _check_flashinfer(fmt: StateFormat, scheme, kind: str, state_shape: tuple[int, ...]) -> None:
    """The flashinfer profile's constraints: the Mamba-2 kernels' formats, scale layout, window and shapes."""
    where = f"{fmt.name}@{scheme.name}"
    if kind != "mamba2":
        raise EngineError(
            f"the flashinfer profile models FlashInfer's Mamba-2 kernels; a {kind} layer is not modelled "
            f"(FlashInfer's gdn_decode is CuTe DSL; vLLM decodes GDN / KDA with fla, which the ideal profile matches)"
        )
    if fmt.scale_mode is ScaleMode.STATIC or (fmt.encoding.scaled and fmt.granularity.rows != 1):
        raise EngineError(f"{where}: FlashInfer keeps one dynamic FP32 scale per (head, dim) row (state_scale)")
    enc, sr = fmt.encoding, fmt.rounding is Rounding.SR
    if scheme.kind is SchemeKind.CONVENTIONAL:
        if enc not in (Encoding.FP32, Encoding.BF16, Encoding.FP16, Encoding.INT16):
            raise EngineError(
                f"{where}: selective_state_update stores fp32, bf16, fp16 or scaled int16 state; "
                f"int8 / fp8_e4m3 state is checkpointing_ssu's (use a replay scheme)"
            )
        if sr and enc is not Encoding.FP16:
            raise EngineError(f"{where}: selective_state_update rounds stochastically only fp16 state (\"only supports fp16 state\")")
        return
    if scheme.kind is SchemeKind.SPEC:
        raise EngineError(
            f"{where}: the flashinfer profile emulates one token per call; speculative checkpointing_ssu calls "
            "run in the oracle (ssmquant.engines.flashinfer.checkpointing_ssu_reference)"
        )
    if enc in (Encoding.NVFP4, Encoding.INT16):
        raise EngineError(f"{where}: checkpointing_ssu stores fp32, bf16, fp16, int8 or fp8_e4m3 state")
    if scheme.buffer_len > MAX_WINDOW:
        raise EngineError(f"{where}: \"checkpointing_ssu supports at most 16 cache tokens (max_window)\"")
    if scheme.buffer_dtype not in ("bf16", "fp16"):
        raise EngineError(f"{where}: checkpointing_ssu keeps its ring in the 2-byte input dtype (bf16 / fp16)")
    if enc in (Encoding.INT8, Encoding.FP8_E4M3) and tuple(state_shape[-2:]) != CKPT_8BIT_SHAPE:
        raise EngineError(
            f"{where}: FlashInfer's 8-bit checkpointing_ssu needs head_dim 64 and d_state 128 "
            f"(\"int8 chain kernel requires DIM == 64\"); this layer has {tuple(state_shape[-2:])}"
        )
    if sr and enc is Encoding.BF16:
        raise EngineError(
            f"{where}: checkpointing_ssu rounds bf16 / fp32 state to nearest (stochastic only for fp16, int8, fp8_e4m3)"
        )


@dataclass
class FlashInferTables:
    """Per-call coefficients of the replay profile (B batch, T steps, H heads, L ring length).

    flush_call [B, T] bool: call t replays the ring into the checkpoint (a write after step t - 1);
    start [B, T] int64: first ring step at call t; held [B, T]: ring tokens at call t (t - start);
    fac [B, T, H]: the output's state factor (exp(total) * exp(cumAdt_t); exp(cumAdt_t) at a flush call);
    cb_new [B, T, H]: bf16 (C_t . B_t) * dt_t; cb_old [B, T, H, L]: bf16 coefficient of ring token i;
    coef [B, T, H, L], total_decay [B, T, H]: the replay of the flush after step t (zero elsewhere).
    """

    flush_call: torch.Tensor
    start: torch.Tensor
    held: torch.Tensor
    fac: torch.Tensor
    cb_new: torch.Tensor
    cb_old: torch.Tensor
    coef: torch.Tensor
    total_decay: torch.Tensor


def _windows(dt: torch.Tensor, start: torch.Tensor, held: torch.Tensor, length: int):
    """Ring dt [B, C, H, L] of every call (zero beyond `held`) and the ring step indices [B, C, L]."""
    i = torch.arange(length, device=dt.device)
    idx = start[..., None] + i  # [B, C, L]
    valid = i < held[..., None]
    steps = dt.shape[1]
    g = torch.gather(dt, 1, idx.clamp(max=steps - 1).reshape(dt.shape[0], -1)[..., None].expand(-1, -1, dt.shape[2]))
    g = g.reshape(*idx.shape, dt.shape[2]).permute(0, 1, 3, 2)  # [B, C, H, L]
    return torch.where(valid[:, :, None, :], g, 0.0), idx, valid


def flashinfer_tables(inputs, write_mask: torch.Tensor, length: int) -> FlashInferTables:
    """The replay profile's coefficients for Mamba-2 inputs under a write schedule (see the class).

    write_mask [B, T] bool on the inputs' device; length: the ring length L (buffer length).
    """
    dt = inputs.dt.float()  # [B, T, H]
    bsz, steps, heads = dt.shape
    dev = dt.device
    a_h = inputs.A.float()
    flush_call = torch.zeros(bsz, steps + 1, dtype=torch.bool, device=dev)
    flush_call[:, 1:] = write_mask
    # call c reads the ring from the last flush call before it
    marks = torch.where(flush_call, torch.arange(steps + 1, device=dev), 0)
    start = torch.cummax(torch.nn.functional.pad(marks[:, :-1], (1, 0)), 1).values  # [B, T + 1]
    held = torch.arange(steps + 1, device=dev) - start
    if int(held.max()) > length:
        raise EngineError(f"the write schedule holds {int(held.max())} tokens in a ring of {length}")
    dtw, idx, valid = _windows(dt, start, held, length)  # [B, T + 1, H, L]
    old_cum = a_h[None, None, :, None] * hs_scan(dtw)
    last = (held - 1).clamp(min=0)[..., None, None].expand(-1, -1, heads, 1)
    total = torch.where(held[..., None] > 0, torch.gather(old_cum, 3, last)[..., 0], 0.0)  # [B, T + 1, H]
    cum = a_h * dt  # [B, T, H]: one token per call, the scan is the value
    e_cum = fast_expf(cum)
    # dot products C_t . B_j, per group, for the new token and the ring tokens of call t
    hpg = heads // inputs.B.shape[2]
    bb, cc = inputs.B.float(), inputs.C.float()
    dot_new = (cc * bb).sum(-1).repeat_interleave(hpg, 2)  # [B, T, H]
    ridx = idx[:, :steps].clamp(max=steps - 1)  # [B, T, L]
    b_ring = torch.gather(bb, 1, ridx.reshape(bsz, -1)[..., None, None].expand(-1, -1, *bb.shape[2:]))
    b_ring = b_ring.reshape(bsz, steps, length, *bb.shape[2:])  # [B, T, L, G, N]
    dot_old = (cc[:, :, None] * b_ring).sum(-1).permute(0, 1, 3, 2).repeat_interleave(hpg, 2)  # [B, T, H, L]
    fc = flush_call[:, :steps, None]
    tot_t, cum_t = total[:, :steps], cum
    w_old = fast_expf(cum_t[..., None] + tot_t[..., None] - old_cum[:, :steps]) * dtw[:, :steps]
    cb_old = torch.where(valid[:, :steps, None, :] & ~fc[..., None], bf16(dot_old * w_old), 0.0)
    fac = torch.where(fc, e_cum, fast_expf(tot_t) * e_cum)
    cb_new = bf16(dot_new * fast_expf(cum_t - cum_t) * dt)
    # the replay of the flush after step t is call t + 1's
    tot_n, cum_n, dtw_n, valid_n = total[:, 1:], old_cum[:, 1:], dtw[:, 1:], valid[:, 1:]
    wm = write_mask[..., None]
    coef = torch.where(wm[..., None] & valid_n[:, :, None, :], fast_expf(tot_n[..., None] - cum_n) * dtw_n, 0.0)
    total_decay = torch.where(wm, torch.where(held[:, 1:, None] > 0, fast_expf(tot_n), 1.0), 0.0)
    return FlashInferTables(flush_call[:, :steps], start[:, :steps], held[:, :steps], fac, cb_new, cb_old, coef, total_decay)
