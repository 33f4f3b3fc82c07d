"""The torch Philox4x32 that the engine profiles draw their stochastic-rounding bits from."""

import torch

from ssmquant.engines import philox


def test_philox_known_answer():
    # Random123's known-answer test for philox4x32-10: counter 0, key 0
    words = philox.philox4x32(0, torch.tensor([0]), 10)[0]
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_mulhilo_equals_the_product_split_into_16_bit_halves():
    """The int64 product's wrap-around keeps the low 64 bits of the unsigned product: the same halves as an
    overflow-free split of b (each partial product < 2^48)."""

    def split(a, b):
        hi_part, lo_part = a * (b >> 16), a * (b & 0xFFFF)
        lo = (((hi_part & 0xFFFF) << 16) + lo_part) & philox.MASK32
        return ((hi_part + (lo_part >> 16)) >> 16) & philox.MASK32, lo

    g = torch.Generator().manual_seed(0)
    b = torch.cat([torch.randint(0, 2**32, (100_000,), generator=g), torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1])])
    for a in (philox._ROUND_A, philox._ROUND_B, 2**32 - 1, 2**31, 1, 0):
        hi, lo = philox._mulhilo(a, b)
        want_hi, want_lo = split(a, b)
        assert torch.equal(hi, want_hi) and torch.equal(lo, want_lo), a
