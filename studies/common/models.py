"""Layer sizes of the studied models (for byte counts): a shipped tiny model's config or a preset's shape."""

from __future__ import annotations

import json
import pathlib

from ssmquant.models.presets import get_preset

ASSETS = pathlib.Path(__file__).resolve().parents[2] / "ssmquant" / "assets"


def layer_dims(model: str) -> dict:
    """kind, heads H, rows d, state_dim n, groups G (Mamba-2 B/C groups; GDN key heads; KDA heads)."""
    cfg_path = ASSETS / model / "config.json"
    if cfg_path.is_file():
        c = json.loads(cfg_path.read_text())
        if "mamba_num_heads" in c:
            return {"kind": "mamba2", "H": c["mamba_num_heads"], "d": c["mamba_head_dim"], "n": c["ssm_state_size"], "G": c["n_groups"]}
        if "linear_num_heads" in c:  # KDA (kimi_linear): one head count, key dim = value dim
            h, d = c["linear_num_heads"], c["linear_head_dim"]
            return {"kind": "kda", "H": h, "d": d, "n": d, "G": h}
        return {
            "kind": "gdn",
            "H": c["linear_num_value_heads"],
            "d": c["linear_value_head_dim"],
            "n": c["linear_key_head_dim"],
            "G": c["linear_num_key_heads"],
        }
    sh = get_preset(model).shape
    if hasattr(sh, "state_size"):
        return {"kind": "mamba2", "H": sh.num_heads, "d": sh.head_dim, "n": sh.state_size, "G": sh.n_groups}
    if sh.kind == "kda":
        return {"kind": "kda", "H": sh.num_heads, "d": sh.head_dim, "n": sh.head_dim, "G": sh.num_heads}
    return {"kind": "gdn", "H": sh.num_value_heads, "d": sh.value_head_dim, "n": sh.key_head_dim, "G": sh.num_key_heads}


def heads_text() -> str:
    parts = []
    for m in ("tiny-nemotron", "tiny-qwen"):
        d = layer_dims(m)
        parts.append(f"{m}: {d['H']} {'Mamba-2' if d['kind'] == 'mamba2' else 'GDN value'} heads per layer")
    return ", ".join(parts)
