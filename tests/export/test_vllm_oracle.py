"""vLLM's own parser and config validators as the oracle for the exported vLLM settings.

For each setting x draft tokens x GPU, the export's rules (engines.violations) must agree with vLLM: a
setting the export runs gives flags that vLLM's `EngineArgs` argument parser reads back unchanged and a
config that vLLM's own validators (MambaConfig, CacheConfig, MambaModelConfig's prefix-caching rule,
VllmConfig's model validators) accept; a setting the export refuses gives, when passed anyway, a config
vLLM rejects. vLLM runs here on a CPU: its platform is replaced by a CUDA platform that reports the
target GPU's compute capability, and Triton is reported present so that Model Runner V2 is the default,
as on a GPU machine. What needs the model itself (the architecture check of --use-replayssm) is not
covered here; the speculative config is given as its draft count.

Runs only where vLLM imports (skipped otherwise). With the wheel unpacked, on a CPU machine:

    pip download --no-deps -d /tmp/w vllm==0.33.0 && unzip -q /tmp/w/vllm-*.whl 'vllm/*.py' -d /tmp/vllm
    pip install --target /tmp/vdeps --no-deps cbor2 pyzmq msgspec cloudpickle pybase64 cachetools uvloop \\
        py-cpuinfo prometheus_client xgrammar apache-tvm-ffi fastapi starlette partial_json_parser llguidance \\
        openai openai_harmony aiohttp opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=$PWD:/tmp/vllm:/tmp/vdeps python -m pytest tests/export/test_vllm_oracle.py
"""

import json
import os
from types import SimpleNamespace

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
from ssmquant.engines.facts import VERSIONS  # noqa: E402
from ssmquant.export import Target, runtime, violations  # noqa: E402
from ssmquant.export.targets import vllm_engine_args, vllm_flags  # noqa: E402
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
from vllm.config import vllm as vllm_config_module  # noqa: E402
from vllm.config.mamba import MambaConfig  # noqa: E402
from vllm.model_executor.models.config import MambaModelConfig  # noqa: E402

PARSER = arg_utils.EngineArgs.add_cli_args(FlexibleArgumentParser())


class _Config(VllmConfig):
    """VllmConfig with the draft count of a speculative config (SpeculativeConfig itself needs the model)."""

    drafts = 0

    @property
    def num_speculative_tokens(self) -> int:
        return type(self).drafts


def vllm_accepts(args: dict, drafts: int, gpu: int, monkeypatch) -> str | None:
    """None if vLLM parses and validates engine `args` on sm`gpu` with `drafts`; else vLLM's error."""
    _TargetGPU.cc = gpu
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)  # Model Runner V2 is the default on a GPU
    for k, v in args.get("env", {}).items():
        monkeypatch.setenv(k, v)
    flags = vllm_flags({k: v for k, v in args.items() if k not in ("env", "speculative_config")})
    try:
        ns = PARSER.parse_args(["--model", "nemotron-h", *flags])
    except SystemExit:
        return "argument parsing failed"
    ea = arg_utils.EngineArgs.from_cli_args(ns)
    for k, v in args.items():  # the parser reads back what the export wrote
        if k not in ("env", "speculative_config"):
            assert getattr(ea, k) == v, (k, getattr(ea, k), v)
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
        plan = SimpleNamespace(setting=s, runtime=runtime(t, s, "mamba2"), draft_tokens=drafts)
        args = vllm_engine_args(plan)
        args["env"] = plan.runtime.env
        assert json.loads(json.dumps(args)) == args
        err = vllm_accepts(args, drafts, gpu, monkeypatch)
        assert err is None, f"vLLM {VLLM_VERSION} rejects the export of {name} (T={drafts}, sm{gpu}): {err}"
        return
    assert {v.rule for v in found} <= CHECKED_BY_VLLM, found
    for backend in ("triton", "flashinfer"):  # whichever backend the user picks, vLLM refuses
        err = vllm_accepts(straightforward_args(s, drafts, backend), drafts, gpu, monkeypatch)
        assert err is not None, f"export refuses {name} (T={drafts}, sm{gpu}) but vLLM takes it on {backend}: {found}"


def test_triton_replay_without_the_model_runner_switch_is_rejected(monkeypatch):
    """vllm.triton_replay_v1: the env the export writes is needed; without it vLLM refuses at start-up."""
    s = Setting.parse("bf16@replay32")
    t = Target.make("vllm", VLLM_VERSION, 90, 0, NANO)
    args = vllm_engine_args(SimpleNamespace(setting=s, runtime=runtime(t, s, "mamba2"), draft_tokens=0))
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert "Triton ReplaySSM requires Model Runner V1" in vllm_accepts(args, 0, 90, monkeypatch)
