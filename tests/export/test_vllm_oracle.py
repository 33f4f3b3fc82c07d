"""vLLM's own parser and config validators as the oracle for the exported vLLM settings.

For each setting x draft tokens x GPU, the export's rules (engines.violations) must agree with vLLM: a
setting the export runs gives flags that vLLM's `EngineArgs` argument parser reads back unchanged and a
config that vLLM's own validators (MambaConfig, CacheConfig, MambaModelConfig's prefix-caching rule,
VllmConfig's model validators, SpeculativeConfig for the speculative config the export writes) accept; a
setting the export refuses gives, when passed anyway, a config vLLM rejects, or (rules vLLM does not
check) one whose layer would not run it as measured, shown on vLLM's own code. Mamba-2 (NemotronH), GDN
(Qwen3.5: its HF patch goes through vLLM's own Qwen3.5 config hook) and KDA (Kimi-K3, GLM-5.3-Flash,
Kimi-Linear: the state dtype through vLLM's MambaStateDtypeCalculator and each layer's call of it,
RecoverSSM through VllmConfig's validator with the architecture). vLLM runs here on a CPU: its platform is
replaced by a CUDA platform that reports the target GPU's compute capability, and Triton is reported
present so that Model Runner V2 is the default, as on a GPU machine. The speculative config is built by
SpeculativeConfig itself for `ngram` (the other methods need the model). The facts' quotes of vLLM's code
are checked against the installed vLLM's source.

Runs only where vLLM imports (skipped otherwise). With the wheel unpacked, on a CPU machine:

    pip download --no-deps -d /tmp/w vllm==0.33.0 && unzip -q /tmp/w/vllm-*.whl 'vllm/*.py' -d /tmp/vllm
    pip install --target /tmp/vdeps --no-deps cbor2 pyzmq msgspec cloudpickle pybase64 cachetools uvloop \\
        py-cpuinfo prometheus_client xgrammar apache-tvm-ffi fastapi starlette partial_json_parser llguidance \\
        openai openai_harmony aiohttp opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \\
        multidict yarl propcache attrs aiohappyeyeballs aiosignal frozenlist sniffio einops
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=$PWD:/tmp/vllm:/tmp/vdeps python -m pytest tests/export/test_vllm_oracle.py
"""

import ast
import json
import os
import pathlib
import re
import sys
from types import SimpleNamespace
from typing import get_args

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
arg_utils = pytest.importorskip("vllm.engine.arg_utils", reason="vLLM is not importable here (see module docstring)")

import vllm.platforms as vllm_platforms  # noqa: E402
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402
from vllm.version import __version__ as VLLM_VERSION  # noqa: E402

from ssmquant.calibrate import Setting  # noqa: E402
from ssmquant.engines.facts import FACTS, VERSIONS  # noqa: E402
from ssmquant.export import Target, runtime, violations  # noqa: E402
from ssmquant.export.plan import Speculation  # noqa: E402
from ssmquant.export.targets import vllm_engine_args, vllm_flags, vllm_hf_patch  # noqa: E402
from ssmquant.kinds import LayerDims  # noqa: E402

pytestmark = pytest.mark.skipif(
    VLLM_VERSION not in VERSIONS["vllm"], reason=f"vLLM {VLLM_VERSION} is not a version the engine facts cover"
)

NANO = LayerDims("mamba2", 64, 64, 128, 8)
# rules vLLM checks at argument parsing or config validation (the others need the model or run in kernels);
# "unreleased" only accompanies "dtype", naming the build that has the dtype
CHECKED_BY_VLLM = {"dtype", "unreleased", "sr", "gpu", "buffer_len", "spec_buffer", "scheme"}


class _TargetGPU(Platform):
    """vLLM's CUDA platform as seen by its config validators, on the export's --gpu."""

    _enum = PlatformEnum.CUDA
    device_name = device_type = "cuda"
    cc = 90

    @classmethod
    def get_device_capability(cls, device_id=0):
        return DeviceCapability(cls.cc // 10, cls.cc % 10)


vllm_platforms.current_platform = _TargetGPU()
from vllm.config import CacheConfig, VllmConfig  # noqa: E402
from vllm.config import speculative as speculative_module  # noqa: E402
from vllm.config import vllm as vllm_config_module  # noqa: E402
from vllm.config.mamba import MambaConfig  # noqa: E402
from vllm.config.speculative import SpeculativeConfig  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator  # noqa: E402
from vllm.model_executor.models.config import (  # noqa: E402
    MambaModelConfig,
    NemotronHForCausalLMConfig,
    Qwen3_5ForConditionalGenerationConfig,
)

# modules that bound vLLM's platform at import (0.34.0's config modules do) see the target GPU too
_TARGET_PLATFORM = vllm_platforms.current_platform
for _name, _module in list(sys.modules.items()):
    if _name.startswith("vllm.") and isinstance(getattr(_module, "current_platform", None), Platform):
        _module.current_platform = _TARGET_PLATFORM

PARSER = arg_utils.EngineArgs.add_cli_args(FlexibleArgumentParser())


class _Config(VllmConfig):
    """VllmConfig with the draft count of a speculative config (SpeculativeConfig itself needs the model)."""

    drafts = 0

    @property
    def num_speculative_tokens(self) -> int:
        return type(self).drafts


def vllm_accepts(args: dict, drafts: int, gpu: int, monkeypatch, env=None) -> str | None:
    """None if vLLM parses and validates engine `args` (with environment `env`) on sm`gpu` with `drafts`;
    else vLLM's error. A speculative config in `args` is built by vLLM's SpeculativeConfig where it can be
    without the model (method ngram) and must carry a method."""
    _TargetGPU.cc = gpu
    if hasattr(vllm_config_module, "HAS_TRITON"):  # up to 0.33.0: Model Runner V2 is the default on a GPU
        monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    flags = vllm_flags(args)
    try:
        ns = PARSER.parse_args(["--model", "nemotron-h", *flags])
    except SystemExit:
        return "argument parsing failed"
    ea = arg_utils.EngineArgs.from_cli_args(ns)
    for k, v in args.items():  # the parser reads back what the export wrote
        assert getattr(ea, k) == v, (k, getattr(ea, k), v)
    if ea.speculative_config is not None:
        spec = dict(ea.speculative_config)
        assert spec.get("method") in _METHODS, spec  # vllm.spec_method: a method vLLM knows
        if spec["method"] == "ngram":
            try:
                drafts = SpeculativeConfig(**spec).num_speculative_tokens
            except Exception as err:  # noqa: BLE001 - any rejection is the answer
                return str(err)
    # vLLM's default for hybrid generative models (vllm/config/model.py is_prefix_caching_supported)
    prefix = True if ea.enable_prefix_caching is None else ea.enable_prefix_caching
    try:
        mamba = MambaConfig(
            backend=ea.mamba_backend,
            enable_stochastic_rounding=ea.enable_mamba_cache_stochastic_rounding,
            stochastic_rounding_philox_rounds=ea.mamba_cache_philox_rounds,
        )
        cache = CacheConfig(
            mamba_ssm_cache_dtype=ea.mamba_ssm_cache_dtype,
            use_replayssm=ea.use_replayssm,
            replayssm_buffer_len=ea.replayssm_buffer_len,
            enable_prefix_caching=prefix,
        )
        MambaModelConfig.verify_and_update_config(
            SimpleNamespace(
                cache_config=cache,
                model_config=SimpleNamespace(max_model_len=4096, architecture="NemotronHForCausalLM"),
                scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
            )
        )
        _Config.drafts = drafts
        _Config(cache_config=cache, mamba_config=mamba)
    except Exception as err:  # noqa: BLE001 - any rejection is the answer
        return str(err).splitlines()[1] if "\n" in str(err) else str(err)
    return None


def _flatten_literal(tp) -> set[str]:
    out = set()
    for a in get_args(tp):
        out |= _flatten_literal(a) if get_args(a) else {a}
    return out


_METHODS = _flatten_literal(speculative_module.SpeculativeMethod)


def _plan(t: Target, s: Setting, kind: str, drafts: int):
    """The parts of an ExportPlan that vllm_engine_args and vllm_hf_patch read (ngram: a drafter vLLM can build
    here without the model)."""
    return SimpleNamespace(
        setting=s, runtime=runtime(t, s, kind), draft_tokens=drafts, architecture=t.arch,
        speculation=Speculation("ngram") if drafts else None,
    )  # fmt: skip


def straightforward_args(setting: Setting, drafts: int, backend: str) -> dict:
    """The engine args a user would pass for a setting the export refuses."""
    args = {"mamba_ssm_cache_dtype": {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(
        setting.encoding, setting.encoding), "use_replayssm": setting.scheme_kind != "conventional",
        "mamba_backend": backend, "enable_mamba_cache_stochastic_rounding": setting.rounding == "sr"}  # fmt: skip
    if args["use_replayssm"]:
        args["replayssm_buffer_len"] = setting.buffer_len
        if backend == "flashinfer":
            args["enable_prefix_caching"] = False
    return args


SETTINGS = ["fp32@conventional", "bf16@conventional", "fp16:sr@conventional", "bf16:sr@conventional", "bf16@replay16",
            "bf16@replay32", "fp16:sr@replay16", "fp16:sr@replay32", "fp16@replay4", "int8@replay16"]  # fmt: skip


@pytest.mark.parametrize("gpu", [90, 100])
@pytest.mark.parametrize("drafts", [0, 3])
@pytest.mark.parametrize("name", SETTINGS)
def test_export_rules_agree_with_vllm(name, drafts, gpu, monkeypatch):
    s = Setting.parse(name)
    t = Target.make("vllm", VLLM_VERSION, gpu, drafts, NANO)
    found = violations(t, s, "mamba2")
    if not found:
        plan = _plan(t, s, "mamba2", drafts)
        args = vllm_engine_args(plan)
        assert json.loads(json.dumps(args)) == args and "env" not in args  # issue 27: env is not an engine argument
        err = vllm_accepts(args, drafts, gpu, monkeypatch, plan.runtime.env)
        assert err is None, f"vLLM {VLLM_VERSION} rejects the export of {name} (T={drafts}, sm{gpu}): {err}"
        return
    assert {v.rule for v in found} <= CHECKED_BY_VLLM, found
    for backend in ("triton", "flashinfer"):  # whichever backend the user picks, vLLM refuses
        err = vllm_accepts(straightforward_args(s, drafts, backend), drafts, gpu, monkeypatch)
        assert err is not None, f"export refuses {name} (T={drafts}, sm{gpu}) but vLLM takes it on {backend}: {found}"


def test_triton_replay_gets_the_runner_environment_its_release_needs(monkeypatch):
    """vllm.triton_replay_v1 (0.30.0 to 0.33.0): the env the export writes is needed; without it vLLM refuses at
    start-up. vllm.v1_runner_removed (0.34.0): the export writes none, vLLM takes the flags, and the variable the
    older exports set stops vLLM's environment check."""
    s = Setting.parse("bf16@replay32")
    t = Target.make("vllm", VLLM_VERSION, 90, 0, NANO)
    plan = _plan(t, s, "mamba2", 0)
    args = vllm_engine_args(plan)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    if t.holds("vllm.triton_replay_v1"):
        assert plan.runtime.env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
        assert "Triton ReplaySSM requires Model Runner V1" in vllm_accepts(args, 0, 90, monkeypatch)
        return
    assert t.holds("vllm.v1_runner_removed") and plan.runtime.env == {}
    assert vllm_accepts(args, 0, 90, monkeypatch) is None
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ValueError, match=re.escape(FACTS["vllm.v1_runner_removed"].quote.format(value="0"))):
        _TargetGPU.validate_environ(hard_fail=False)


# -- the speculative config (issue 26.3) ---------------------------------------------------------------------
def test_a_speculative_config_without_a_method_is_refused_and_the_exported_one_is_built():
    """vllm.spec_method: "num_speculative_tokens was provided but without speculative model."."""
    with pytest.raises(Exception, match="num_speculative_tokens was provided but without speculative model"):
        SpeculativeConfig(num_speculative_tokens=3)
    s = Setting.parse("bf16@spec16x3")
    args = vllm_engine_args(_plan(Target.make("vllm", VLLM_VERSION, 100, 3, NANO), s, "mamba2", 3))
    assert args["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert SpeculativeConfig(**args["speculative_config"]).num_speculative_tokens == 3
    assert set(("mtp", "ngram", "eagle", "eagle3", "draft_model")) <= _METHODS  # the export's SPEC_METHODS


# -- GDN: Qwen3.5 -----------------------------------------------------------------------------------------------
QWEN = LayerDims("gdn", 32, 128, 128, 16)
GDN_CHECKED_BY_VLLM = {"dtype", "unreleased"}  # "sr", "layer_kind": vLLM takes the flags and does not apply them


@pytest.mark.parametrize("arch", ["Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"])
@pytest.mark.parametrize("name", ["fp32@conventional", "bf16@conventional", "fp16@conventional", "fp16:sr@conventional",
                                  "bf16@replay16", "int8@conventional"])  # fmt: skip
def test_gdn_exports_agree_with_vllm(name, arch, monkeypatch):
    s = Setting.parse(name)
    t = Target.make("vllm", VLLM_VERSION, 90, 0, QWEN, arch)
    found = violations(t, s, "gdn")
    if found:
        if {v.rule for v in found} <= GDN_CHECKED_BY_VLLM:
            assert vllm_accepts(straightforward_args(s, 0, "triton"), 0, 90, monkeypatch) is not None
        return
    plan = _plan(t, s, "gdn", 0)
    assert vllm_accepts(vllm_engine_args(plan), 0, 90, monkeypatch) is None
    # issue 26.4: the HF patch, applied to the checkpoint's config, gives the measured dtype through vLLM's own
    # Qwen3.5 hook with --mamba-ssm-cache-dtype auto (it reads hf_text_config)
    patch, _ = vllm_hf_patch(plan, SimpleNamespace(layer_kind="gdn"))
    text = SimpleNamespace(**patch.get("text_config", patch))
    cache = CacheConfig(mamba_ssm_cache_dtype="auto")
    Qwen3_5ForConditionalGenerationConfig.verify_and_update_config(
        SimpleNamespace(cache_config=cache, model_config=SimpleNamespace(hf_text_config=text))
    )
    assert cache.mamba_ssm_cache_dtype == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[s.encoding]
    # a top-level key would not reach a multimodal checkpoint's text config
    assert ("text_config" in patch) == arch.endswith("ForConditionalGeneration")


def test_nemotron_h_reads_an_unchecked_hf_dtype_so_8bit_never_goes_into_the_patch():
    """issue 26.5, on vLLM's own code: with the flag at auto NemotronH takes any HF value, int8 included."""
    cache = CacheConfig(mamba_ssm_cache_dtype="auto")
    NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype(
        cache_config=cache, hf_config=SimpleNamespace(mamba_ssm_cache_dtype="int8")
    )
    assert cache.mamba_ssm_cache_dtype == "int8"  # accepted silently: no scales will exist
    plan = SimpleNamespace(setting=Setting.parse("int8@replay16"), architecture="NemotronHForCausalLM")
    assert vllm_hf_patch(plan, SimpleNamespace(layer_kind="mamba2"))[0] is None
    with pytest.raises(Exception, match="mamba_ssm_cache_dtype"):  # the engine-args JSON is refused by the release
        CacheConfig(mamba_ssm_cache_dtype="int8")


# -- KDA: Kimi-K3, GLM-5.3-Flash, Kimi-Linear ---------------------------------------------------------------------
GLM = LayerDims("kda", 64, 128, 128, 64)
VLLM_ROOT = pathlib.Path(arg_utils.__file__).resolve().parents[1]
KDA_LAYER_FILE = {
    "KimiK3ForConditionalGeneration": "models/kimi_k3/nvidia/kda.py",
    "Glm5NextForConditionalGeneration": "models/glm5next/common/kda.py",
    "KimiLinearForCausalLM": "model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py",
}
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _layer_passes_ssm_dtype(arch: str) -> bool:
    """Whether the architecture's KDA layer passes the SSM cache dtype to kda_state_dtype (its third argument)."""
    tree = ast.parse((VLLM_ROOT / KDA_LAYER_FILE[arch]).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "kda_state_dtype"]
    return any(len(c.args) >= 3 for c in calls)


def _recoverssm_error(arch: str, drafts: int, args: dict) -> str | None:
    """VllmConfig.validate_mamba_cached_kernel (vllm/config/vllm.py) on the export's flags, with the architecture."""
    ns = PARSER.parse_args(["--model", "m", *vllm_flags(args)])
    ea = arg_utils.EngineArgs.from_cli_args(ns)
    cfg = SimpleNamespace(
        cache_config=CacheConfig(mamba_ssm_cache_dtype=ea.mamba_ssm_cache_dtype, use_replayssm=ea.use_replayssm,
                                 replayssm_buffer_len=ea.replayssm_buffer_len),
        model_config=SimpleNamespace(architecture=arch, supports_replayssm=arch != "Glm5NextForConditionalGeneration"),
        mamba_config=MambaConfig(backend=ea.mamba_backend), num_speculative_tokens=drafts,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1), use_v2_model_runner=True, kv_transfer_config=None,
    )  # fmt: skip
    try:
        VllmConfig.validate_mamba_cached_kernel(cfg)
    except ValueError as err:
        return str(err)
    return None if cfg.cache_config.use_kda_recoverssm else "RecoverSSM is off"


@pytest.mark.parametrize("arch", list(KDA_LAYER_FILE))
@pytest.mark.parametrize("name, drafts", [("fp32@conventional", 0), ("bf16@conventional", 0), ("fp16@conventional", 0),
                                          ("fp32@spec5x4:fp32", 4), ("bf16@spec5x4:fp32", 4)])  # fmt: skip
def test_kda_exports_agree_with_vllm(name, drafts, arch, monkeypatch):
    s = Setting.parse(name)
    t = Target.make("vllm", VLLM_VERSION, 90, drafts, GLM, arch)
    found = violations(t, s, "kda")
    flag = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[s.encoding]
    follows = _layer_passes_ssm_dtype(arch)
    if not found:
        plan = _plan(t, s, "kda", drafts)
        args = vllm_engine_args(plan)
        if drafts:  # RecoverSSM depends on the architecture: VllmConfig's validator with it
            assert _recoverssm_error(arch, drafts, args) is None
        else:
            assert vllm_accepts(args, drafts, 90, monkeypatch) is None
        assert vllm_hf_patch(plan, SimpleNamespace(layer_kind="kda"))[0] is None  # vLLM reads no HF key for KDA
        # the state the layer allocates is the measured dtype
        dtype = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto", *((flag,) if follows else ()))[1]
        assert dtype == TORCH[s.encoding]
        return
    rules = {v.rule for v in found}
    if "dtype" in rules:  # vLLM raises for the dtype, or its layer would silently keep float32
        try:
            got = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto", *((flag,) if follows else ()))[1]
        except ValueError as err:
            assert "KDA recurrent state supports only auto, float32, and bfloat16" in str(err)
        else:
            assert got != TORCH.get(s.encoding), (arch, name)
    if drafts and "layer_kind" in rules:  # RecoverSSM off Kimi-K3: refused, or accepted by a layer that ignores it
        args = {"mamba_ssm_cache_dtype": flag, "use_replayssm": True, "replayssm_buffer_len": 5, "mamba_backend": "triton"}
        err = _recoverssm_error(arch, drafts, args)
        if arch == "Glm5NextForConditionalGeneration":
            assert "--use-replayssm is not supported for architecture" in err
        else:
            assert err is None and "use_kda_recoverssm" not in (VLLM_ROOT / KDA_LAYER_FILE[arch]).read_text()


# -- the facts quote vLLM's code -------------------------------------------------------------------------------
_NOT_IN_SOURCE = {"vllm.state_dtype"}  # argparse's own words, checked by the parser tests above


def _squash(text: str) -> str:
    """Whitespace and Python's implicit string concatenation removed, so a quote matches across source lines."""
    return re.sub(r'"f?"|\'f?\'', "", re.sub(r"\s+", "", text))


@pytest.mark.parametrize("fid", [f for f, x in FACTS.items() if x.engine == "vllm" and x.quote and "(description)" not in x.sources[0].path])
def test_fact_quotes_are_in_vllm_source(fid):
    f = FACTS[fid]
    if fid in _NOT_IN_SOURCE or not f.holds(VLLM_VERSION):
        pytest.skip(f"{fid}: not vLLM {VLLM_VERSION}'s source words")
    text = "".join(_squash((VLLM_ROOT.parent / x.path).read_text()) for x in f.sources if (VLLM_ROOT.parent / x.path).exists())
    for part in re.split(r"\[\.\.\.\]|\{[^}]*\}", f.quote):
        if _squash(part):
            assert _squash(part) in text or _squash(part).replace('"', "'") in text, (fid, part)
