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


def test_support_rows_give_bf16_kda_state_to_fused_kda_decode_on_sm100_only():
    """flashinfer.fused_kda_decode (flashinfer-python 0.7.0.post1 to 0.7.4, flashinfer/kda_decode.py): "Paged
    recurrent state with shape ``[num_slots, H, 128, 128]`` and dtype float32 or bfloat16.", SM 100 / 103: the bf16
    KDA rows of sm100 cite it where its release takes the heads (64 from 0.7.4, 32 always); on sm90 no FlashInfer
    KDA kernel runs."""
    rows = support_rows("flashinfer")
    kda = [r for r in rows if r["kind"].startswith("KDA")]
    assert all(r["runs"] == () for r in kda if r["gpu"] == "sm90")
    b200 = {(r["kind"], v): r for r in kda if r["gpu"] == "sm100" for v in r["versions"]}
    for kind, version in (("KDA (GLM-5.3-Flash)", "0.7.4"), ("KDA (Kimi-K3)", "0.7.4"), ("KDA (Kimi-Linear)", "0.7.0.post1")):
        r = b200[kind, version]
        assert "bf16@conventional" in r["runs"] and "flashinfer.fused_kda_decode" in r["facts"]
        assert "flashinfer.kda_decode" not in r["facts"]  # recurrent_kda is not needed for these layers
    # 0.7.2.post1's fused kernel has no 64-head build: GLM-5.3-Flash's bf16 state decodes on recurrent_kda
    r = b200["KDA (GLM-5.3-Flash)", "0.7.2.post1"]
    assert "bf16@conventional" in r["runs"] and "flashinfer.kda_decode" in r["facts"]
