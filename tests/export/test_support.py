"""EXPORT.md (repository root) is generated from the engine facts and must be current."""

import pathlib

from ssmquant.export.support import support_markdown, support_rows

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_export_md_is_generated_from_the_facts_and_current():
    """Regenerate with the command in ssmquant/export/support.py's docstring when a fact changes."""
    assert (ROOT / "EXPORT.md").read_text() == support_markdown()


def test_support_rows_follow_the_versioned_kda_rules():
    """vLLM 0.32.0 vllm/models/glm5next/common/kda.py passes `self.cache_config.mamba_ssm_cache_dtype,`: GLM-5.3-Flash
    keeps a bf16 KDA state from 0.32.0, not in 0.31.0; Kimi-Linear never (kimi_gdn_linear_attn.py)."""
    rows = [r for r in support_rows("vllm") if r["gpu"] == "sm90"]
    glm = {v: r["runs"] for r in rows if r["kind"] == "KDA (GLM-5.3-Flash)" for v in r["versions"]}
    assert "bf16@conventional" in glm["0.32.0"] and "bf16@conventional" not in glm["0.31.0"]
    assert all(r["runs"] == ("fp32@conventional",) for r in rows if r["kind"] == "KDA (Kimi-Linear)")
