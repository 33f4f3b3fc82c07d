"""checkpointing_ssu's stochastic rounding counts Philox offsets from the start of the whole cache.

kernel_checkpointing_ssu_8bit.cuh (FlashInfer 0.7.2.post1): `state_ptr_offset = cache_slot * state_stride_seq
+ head * DIM * DSTATE`, then `philox_off = state_ptr_offset + row_lo * DSTATE + col`: cache slot 1 draws other
words than slot 0. (The re-computation used slot 0's words for every slot: on the H200, SR codes matched
83.5%, the mean of slot 0 (exact) and slot 1 (other random words).)
"""

from __future__ import annotations

import torch

from ssmquant.engines import flashinfer as fi
from ssmquant.engines import philox


def test_words_of_a_slot_are_those_of_the_whole_cache_at_that_slot():
    full = philox.checkpoint_8bit_words(77, (3, 2, 64, 128), 10)
    one = philox.checkpoint_8bit_words(77, (1, 2, 64, 128), 10, first_slot=2)[0]
    assert torch.equal(one, full[2])
    assert not torch.equal(full[1], full[0])


def test_reference_rounds_each_cache_slot_with_its_own_words():
    g = torch.Generator().manual_seed(3)
    heads, p, n, ring = 8, 64, 128, 5
    state = (torch.randn(1, heads, p, n, generator=g) * 40).round().clamp(-127, 127).to(torch.int8).repeat(2, 1, 1, 1)
    scale = (torch.rand(1, heads, p, generator=g) * 0.01 + 1e-3).repeat(2, 1, 1)
    x_cache = torch.randn(1, heads, ring, p, generator=g).to(torch.bfloat16).repeat(2, 1, 1, 1)
    b_cache = torch.randn(1, 1, ring, n, generator=g).to(torch.bfloat16).repeat(2, 1, 1, 1)
    dt_cache = (torch.rand(1, heads, ring, generator=g) * 0.1).repeat(2, 1, 1)
    start = torch.zeros(2, dtype=torch.int32)
    pnat = torch.full((2,), 4, dtype=torch.int32)  # 4 + 1 > max_window 4: this call flushes
    x = torch.randn(1, 1, heads, p, generator=g).to(torch.bfloat16).repeat(2, 1, 1, 1)
    dt = (torch.rand(1, 1, heads, generator=g) * 0.1).repeat(2, 1, 1)
    bm = torch.randn(1, 1, 1, n, generator=g).to(torch.bfloat16).repeat(2, 1, 1, 1)
    cm = torch.randn(1, 1, 1, n, generator=g).to(torch.bfloat16).repeat(2, 1, 1, 1)
    A, D = -torch.rand(heads, generator=g), torch.rand(heads, generator=g)
    before = state.clone(), scale.clone()
    seed = philox.engine_seed(5, 0)
    fi.checkpointing_ssu_reference(
        state, scale, x_cache, b_cache, dt_cache, start, pnat, x, dt, A, bm, cm, D, rand_seed=seed
    )  # fmt: skip
    assert torch.equal(scale[0], scale[1])  # identical rows: identical scales ...
    assert not torch.equal(state[0], state[1])  # ... but each slot its own random words
    # slot 1 redone with slot 1's words through the public pieces
    s0, sc0 = before
    old_cum = A[:, None] * fi.hs_scan(dt_cache[1][:, :4])
    total = old_cum[:, -1]
    coef = fi.fast_expf(total[:, None] - old_cum) * dt_cache[1][:, :4]
    rep = fi.replay_8bit(
        s0[1].float(), sc0[1], fi.fast_expf(total), x_cache[1][:, :4].float(), coef,
        b_cache[1][:, :4].float().repeat_interleave(heads, 0),
    )  # fmt: skip
    chunk = philox.checkpoint_8bit_words(seed, (1, heads, p, n), 10, first_slot=1)[0]
    codes, dec = fi.encode_rows_fast(rep, torch.int8, chunk)
    assert torch.equal(state[1], codes.to(torch.int8)) and torch.equal(scale[1], dec)
