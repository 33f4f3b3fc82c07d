"""The plain FP32 decode of any layer kind (no format, no scheme): the ground truth of every emulated variant.

The per-step arithmetic is the kind's ``Physics.advance`` (``ssmquant.kinds``), shared with the emulating
references in `naive.py`, so that a variant in format fp32 reproduces this reference bit for bit. The oracle
tests check it against transformers' own decode paths.
"""

from __future__ import annotations

import torch

from .. import kinds
from ..kinds import LayerInputs, is_validated


def reference_decode(
    inputs: LayerInputs, *, return_states: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decode all T steps in FP32 with no storage rounding.

    Returns (y [B, T, H, rows] (Mamba-2: including the D skip term), final_state [B, H, rows, state_dim] (the
    delta rules: transformers' [Dk, Dv] transposed), states [B, T, H, rows, state_dim] after every step when
    return_states, else None). The inputs are validated here (unless `is_validated`: unchanged since they passed).
    """
    if not is_validated(inputs):  # (unchanged since it passed: not again)
        inputs.validate()
    bsz, steps, heads, rows, sdim = inputs.batch, inputs.steps, inputs.num_heads, inputs.rows, inputs.state_dim
    dev = inputs.device
    state = (
        torch.zeros(bsz, heads, rows, sdim, device=dev, dtype=torch.float32)
        if inputs.initial_state is None
        else inputs.initial_state.float().clone()
    )
    ys = torch.empty(bsz, steps, heads, rows, device=dev, dtype=torch.float32)
    states = torch.empty(bsz, steps, heads, rows, sdim, device=dev) if return_states else None
    physics = kinds.of(inputs).physics(inputs)
    for t in range(steps):
        state, ys[:, t] = physics.advance(state, t)
        if states is not None:
            states[:, t] = state
    return ys, state, states
