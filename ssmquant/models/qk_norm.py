"""The q / k L2 normalisations of the delta-rule mixers, in fp32, as transformers computes them.

Captured inputs (``capture``) and synthetic ones (``synthetic``) must normalise q and k exactly as the model
does: the two formulas below differ in the last bit, and the recurrence carries that difference.
"""

from __future__ import annotations

import torch

# the eps of transformers' l2norm (transformers 5.24 models/qwen3_next and models/glm5_next `l2norm`, eps=1e-6)
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """GDN (Qwen3.5, Qwen3-Next) q / k over the last dim: x * rsqrt(sum(x^2) + eps), the FLA formula
    (transformers 5.24 models/qwen3_next `l2norm`). x: [..., D], any float dtype; returns fp32 [..., D]."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def kda_l2norm(x: torch.Tensor) -> torch.Tensor:
    """KDA (GLM-5.3-Flash, Kimi-Linear) q / k over the last dim: x / sqrt(sum(x^2) + eps), "to match original
    triton" (transformers 5.24 models/glm5_next and models/kimi_linear `l2norm`). x: [..., D]; returns fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


__all__ = ["L2NORM_EPS", "kda_l2norm", "l2norm"]
