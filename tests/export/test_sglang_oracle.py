"""SGLang's own argument parser and server-argument hooks as the oracle for the exported SGLang flags.

For each setting x layer kind (Mamba-2 / GDN / KDA) x architecture x draft tokens x GPU, the export's rules
(engines.violations, facts sglang.*) must agree with SGLang: a setting the export runs gives flags that SGLang's
`ServerArgs` argument parser (the msgspec fields of sglang/srt/arg_groups/fields) reads back unchanged and that the
resolution hooks SGLang runs on them accept, in the pipeline's order (sglang/srt/arg_groups/pipeline.py): the
hybrid-Mamba radix-cache resolution and validation of handle_model_specific_adjustments (model_hook.py
handle_mamba_radix_cache, with the Kimi / GLM-5-Next linear-attention defaults), handle_mamba_backend
(mamba_hook.py), handle_linear_attn_backend (attention_hook.py), handle_speculative_decoding (speculative_hook.py)
and handle_environment_variables (serving_hook.py); after them the resolved record must still be what the export
measured (the SSM dtype, also through SGLANG_MAMBA_SSM_DTYPE and configs/mamba_utils.py; the Triton decode; a
linear draft chain of 1 + drafts tokens). A setting the export refuses for a rule SGLang itself checks (the
--mamba-ssm-dtype choices, stochastic rounding into a non-float16 state) gives, when passed anyway, flags SGLang
rejects. The model is a stand-in holding only `architectures` (SGLang's `model_config_of` hands back a
configuration a fixture put on the record), so the hooks that read the checkpoint do not run.

SGLang runs here on a CPU: its platform facts are set with SGLang's own `override_platform` (CUDA, the target
GPU's SM, FlashInfer present), torch.cuda.get_device_capability reports the target GPU, and where FlashInfer is
not importable an empty `flashinfer.mamba` stands in for the import handle_mamba_backend makes. Where
torchvision is absent (SGLang's VL configs import it at module level), empty modules stand in for it after
`import sglang`. The facts' quotes of SGLang's code are checked against the installed SGLang's source.

Runs only where SGLang imports and is a version the facts cover (skipped otherwise). With the wheel unpacked, on
a CPU machine (the JIT kernel loader checks at import that its include/ and csrc/ folders exist):

    pip download --no-deps -d /tmp/sgw sglang==0.5.23 && unzip -q /tmp/sgw/sglang-*.whl 'sglang/*.py' -d /tmp/sglang
    mkdir -p /tmp/sglang/sglang/kernels/jit/include /tmp/sglang/sglang/kernels/jit/csrc
    pip install --target /tmp/sgdeps --no-deps msgspec orjson pybase64 starlette pyzmq ipython traitlets aiohttp \\
        multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist dill apache-tvm-ffi sentencepiece \\
        compressed-tensors loguru gguf
    PYTHONPATH=$PWD:/tmp/sglang:/tmp/sgdeps python -m pytest tests/export/test_sglang_oracle.py
"""

import argparse
import importlib.machinery
import importlib.util
import os
import pathlib
import re
import sys
import types
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not importable here (see module docstring)")
from sglang.version import __version__ as SGLANG_VERSION  # noqa: E402

from ssmquant.calibrate import Setting  # noqa: E402
from ssmquant.engines.facts import FACTS, VERSIONS  # noqa: E402
from ssmquant.export import Target, runtime, violations  # noqa: E402
from ssmquant.export.plan import SGLANG_ALGORITHM, Speculation  # noqa: E402
from ssmquant.export.targets import sglang_args, sglang_flags  # noqa: E402
from ssmquant.kinds import LayerDims  # noqa: E402

if SGLANG_VERSION not in VERSIONS["sglang"]:
    pytest.skip(f"SGLang {SGLANG_VERSION} is not a version the engine facts cover", allow_module_level=True)


def _stand_in(name: str) -> types.ModuleType:
    """An empty package whose attributes are empty classes (import-time names only)."""
    module = types.ModuleType(name)
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def attribute(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    module.__getattr__ = attribute
    return module


# after `import sglang` (transformers has decided torchvision is absent): SGLang's VL configs import it at module level
if importlib.util.find_spec("torchvision") is None:
    for _name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        sys.modules[_name] = _stand_in(_name)

server_args_module = pytest.importorskip("sglang.srt.server_args", reason="SGLang's server args do not import")
from sglang.srt.arg_groups import attention_hook, mamba_hook, model_hook, serving_hook, speculative_hook  # noqa: E402
from sglang.srt.arg_groups.arg_utils import record_fields  # noqa: E402
from sglang.srt.arg_groups.glm5_next_hook import apply_glm5_next_spec_backend_defaults  # noqa: E402
from sglang.srt.arg_groups.kimi_k3_hook import (  # noqa: E402
    apply_kimi_k3_linear_attn_defaults,
    apply_kimi_k3_spec_backend_defaults,
)
from sglang.srt.arg_groups.overrides import (  # noqa: E402
    _page_size_default,
    declare_resolution,
    resolved_view,
    run_post_process_pass,
)
from sglang.srt.configs.mamba_utils import mamba2_state_dtype  # noqa: E402
from sglang.srt.runtime_context import override_platform  # noqa: E402

ServerArgs = server_args_module.ServerArgs
SGLANG_ROOT = pathlib.Path(sys.modules["sglang"].__file__).resolve().parent
PARSER = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(PARSER)

NANO = LayerDims("mamba2", 64, 64, 128, 8)
QWEN = LayerDims("gdn", 32, 128, 128, 16)
GLM = LayerDims("kda", 64, 128, 128, 64)
DIMS = {"mamba2": NANO, "gdn": QWEN, "kda": GLM}
ARCHS = {
    "mamba2": ["NemotronHForCausalLM"],
    "gdn": ["Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"],
    "kda": ["KimiLinearForCausalLM", "KimiK3ForConditionalGeneration", "Glm5NextForConditionalGeneration"],
}
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (rule, fact) pairs SGLang checks at argument parsing or in its hooks; the others are ssmquant's model of what
# runs as measured (which layers round stochastically, what the rings hold, the verify of a replay window, a spec
# state that is not float32, FlashInfer's SM floor) or SGLang checks them in the memory pool it builds with the
# model (the KDA verify ring)
CHECKED_BY_SGLANG = {("dtype", "sglang.state_dtype"), ("nvfp4", "sglang.state_dtype"), ("sr", "sglang.sr")}


@pytest.fixture
def sglang_gpu(monkeypatch):
    """SGLang's platform facts as on a CUDA machine with the given SM (a callable: sm -> context manager); SGLang's
    environment variables written by its hooks are restored afterwards."""
    if importlib.util.find_spec("flashinfer") is None:  # handle_mamba_backend imports flashinfer.mamba
        monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
        monkeypatch.setitem(sys.modules, "flashinfer.mamba", types.ModuleType("flashinfer.mamba"))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    saved = dict(os.environ)

    def on(gpu: int):
        major, minor = gpu // 10, gpu % 10
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (major, minor))
        return override_platform(
            is_cuda=True, is_hip=False, is_npu=False, is_xpu=False, is_musa=False, is_mps=False,
            is_sm90=major == 9, is_sm100=major == 10, is_sm100_or_sm110=major in (10, 11), is_sm110=major == 11,
            is_sm120=major == 12, is_blackwell=major in (10, 11, 12), is_hopper_with_cuda_12_3=major == 9,
            has_flashinfer=True, device_sm=gpu, device_capability=(major, minor),
        )  # fmt: skip

    yield on
    os.environ.clear()
    os.environ.update(saved)


def parse(args: dict):
    """SGLang's parser on the flags of `args`: the ServerArgs record, or None where argparse refuses them."""
    try:
        ns = PARSER.parse_args(["--model-path", "stand-in", *sglang_flags(args)])
    except SystemExit:
        return None
    return ServerArgs.from_cli_args(ns)


def sglang_resolves(args: dict, arch: str, gpu: int, on):
    """(resolved view, None) if SGLang parses the flags of `args` and its hooks accept them for a model of
    architecture `arch` on sm`gpu`; (None, SGLang's error) otherwise."""
    sa = parse(args)
    if sa is None:
        return None, "argument parsing failed"
    for k, v in args.items():  # the parser reads back what the export wrote
        assert getattr(sa, k.replace("-", "_")) == v, (k, getattr(sa, k.replace("-", "_")), v)
    # what run_resolution_pipeline sets up, with the model a fixture: model_config_of returns it as it is
    sa._raw_input = {f.name: getattr(sa, f.name) for f in record_fields(type(sa))}
    sa._resolved_overrides = []
    hf = SimpleNamespace(architectures=[arch], model_type=arch)
    sa._model_config = SimpleNamespace(hf_config=hf, is_multimodal=False)
    declare_resolution(sa, "_handle_missing_default_values", device="cuda")  # get_device() on a CUDA machine
    with on(gpu):
        try:
            # handle_model_specific_adjustments: the radix-cache strategy of a hybrid model, the Kimi / GLM defaults
            model_hook.handle_mamba_radix_cache(sa, hf)
            if arch in ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration"):
                apply_kimi_k3_linear_attn_defaults(sa)
                apply_kimi_k3_spec_backend_defaults(sa)
            if arch == "Glm5NextForConditionalGeneration":
                apply_glm5_next_spec_backend_defaults(sa)
            mamba_hook.handle_mamba_backend(sa)
            mamba_hook.handle_int8_mamba_checkpoint(sa)
            attention_hook.handle_linear_attn_backend(sa)
            run_post_process_pass(sa, _page_size_default)
            speculative_hook.handle_speculative_decoding(sa)
            serving_hook.handle_environment_variables(sa)
        except (ValueError, AssertionError, NotImplementedError) as err:
            return None, f"{type(err).__name__}: {err}"
    return resolved_view(sa), None


def _plan(t: Target, s: Setting, kind: str, drafts: int, method: str):
    """The parts of an ExportPlan that sglang_args reads (mtp / ngram: drafters that need no checkpoint)."""
    return SimpleNamespace(
        setting=s, runtime=runtime(t, s, kind), draft_tokens=drafts, speculation=Speculation(method) if drafts else None
    )


def straightforward_args(s: Setting, kind: str, drafts: int) -> dict:
    """The flags a user would pass for a setting the export refuses."""
    args: dict = {
        "mamba-ssm-dtype": {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(s.encoding, s.encoding)
    }
    if kind == "mamba2":
        args["mamba-backend"] = "flashinfer"
    else:
        args["linear-attn-decode-backend"] = "triton"
    if s.rounding == "sr":
        args["enable-mamba-cache-stochastic-rounding"] = True
    if s.scheme_kind != "conventional":
        args["enable-linear-replayssm-spec" if s.scheme_kind == "spec" else "enable-linear-replayssm"] = True
        args["linear-replayssm-cache-len"] = s.buffer_len
    if drafts:
        args |= {"speculative-algorithm": "NEXTN", "speculative-num-steps": drafts, "speculative-eagle-topk": 1,
                 "speculative-num-draft-tokens": drafts + 1}  # fmt: skip
    return args


CASES = {  # (setting, draft tokens) per layer kind
    "mamba2": [("fp32@conventional", 0), ("bf16@conventional", 0), ("fp16@conventional", 0), ("fp16:sr@conventional", 0),
               ("bf16:sr@conventional", 0), ("int8@conventional", 0),
               ("nvfp4@conventional", 0), ("bf16@replay16", 0), ("bf16@conventional", 3), ("fp16:sr@conventional", 3),
               ("bf16@conventional+int8col", 0), ("fp16:sr@conventional+int8col", 0)],
    "gdn": [("fp32@conventional", 0), ("bf16@conventional", 0), ("fp16@conventional", 0), ("fp16:sr@conventional", 0),
            ("int8@conventional", 0), ("bf16@replay16", 0), ("bf16@replay8", 0), ("fp16@replay16", 0),
            ("fp32@replay16:fp32", 0), ("fp32@replay16", 0), ("bf16@conventional", 3), ("bf16@replay16", 3),
            ("fp32@spec16x3", 3), ("bf16@spec16x3", 3), ("bf16@conventional+int8col", 0),
            ("bf16@replay16+int8col", 0), ("fp32@spec16x3+int8col", 3)],
    "kda": [("fp32@conventional", 0), ("bf16@conventional", 0), ("fp16@conventional", 0), ("int8@conventional", 0),
            ("bf16@replay16", 0), ("fp32@replay16:fp32", 0), ("bf16@conventional", 3), ("fp32@spec16x3", 3),
            ("fp32@spec4x3", 3), ("fp32@spec12x3", 3), ("bf16@conventional+int8col", 0),
            ("bf16@replay16+int8col", 0)],
}  # fmt: skip
PARAMS = [
    pytest.param(kind, arch, name, drafts, id=f"{kind}-{arch}-{name}-T{drafts}")
    for kind, cases in CASES.items()
    for arch in ARCHS[kind]
    for name, drafts in cases
]


@pytest.mark.parametrize("gpu", [90, 100])
@pytest.mark.parametrize("kind, arch, name, drafts", PARAMS)
def test_export_rules_agree_with_sglang(kind, arch, name, drafts, gpu, sglang_gpu, monkeypatch):
    s = Setting.parse(name)
    t = Target.make("sglang", SGLANG_VERSION, gpu, drafts, DIMS[kind], arch)
    found = violations(t, s, kind)
    if found:
        checked = {(v.rule, v.fact) for v in found} & CHECKED_BY_SGLANG
        if checked:  # passed anyway, SGLang refuses them
            _, err = sglang_resolves(straightforward_args(s, kind, drafts), arch, gpu, sglang_gpu)
            assert err is not None, f"export refuses {name} ({kind}, T={drafts}, sm{gpu}) but SGLang takes it: {found}"
        return
    for method in ("mtp", "ngram") if drafts else ("mtp",):
        plan = _plan(t, s, kind, drafts, method)
        args = sglang_args(plan)
        view, err = sglang_resolves(args, arch, gpu, sglang_gpu)
        where = f"{name} ({kind}, {arch}, T={drafts}{', ' + method if drafts else ''}, sm{gpu})"
        assert err is None, f"SGLang {SGLANG_VERSION} rejects the export of {where}: {err}; flags {sglang_flags(args)}"
        # what SGLang resolved is what the export measured
        dtype = args["mamba-ssm-dtype"]
        assert view.mamba_ssm_dtype == dtype, where
        assert os.environ.get("SGLANG_MAMBA_SSM_DTYPE") == dtype, where  # handle_environment_variables
        # sglang.dtype_order: the variable wins over the checkpoint's key, for the layer's state
        checkpoint = SimpleNamespace(mamba_ssm_dtype="float32" if dtype != "float32" else "bfloat16")
        assert mamba2_state_dtype(checkpoint).temporal == TORCH[dtype], where
        # sglang.int8_checkpoint: the prefix cache keeps int8 states exactly where the setting measured them
        assert view.enable_int8_mamba_checkpoint == (s.prompt_store == "int8col"), where
        if kind == "mamba2":
            assert view.mamba_backend == "flashinfer", where
            assert view.enable_mamba_cache_stochastic_rounding == (s.rounding == "sr"), where
        else:
            assert view.linear_attn_decode_backend == "triton", where
            assert view.enable_linear_replayssm == (s.scheme_kind == "replay"), where
            assert view.enable_linear_replayssm_spec == (s.scheme_kind == "spec"), where
            if plan.runtime.replay:
                assert view.linear_replayssm_cache_len == plan.runtime.window, where
        if drafts:  # the draft chain the export sized (sglang.spec_states) and the fold-every-commit verify needs
            assert view.speculative_algorithm == {"NEXTN": "EAGLE"}.get(
                SGLANG_ALGORITHM[method], SGLANG_ALGORITHM[method]
            ), where  # fmt: skip
            assert (view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (1, drafts + 1), (
                f"SGLang {SGLANG_VERSION} runs the export of {where} as a draft tree of topk "
                f"{view.speculative_eagle_topk} x {view.speculative_num_draft_tokens} tokens, not a chain of {drafts + 1}"
            )


# -- the rules the export relies on, on SGLang's own hooks ---------------------------------------------------------
def test_int8_and_nvfp4_fail_the_dtype_choices():
    """sglang.state_dtype: --mamba-ssm-dtype choices=["float32", "bfloat16", "float16"]."""
    for dtype in ("int8", "fp8", "nvfp4"):
        assert parse({"mamba-ssm-dtype": dtype}) is None
    for dtype in ("float32", "bfloat16", "float16"):
        assert parse({"mamba-ssm-dtype": dtype}).mamba_ssm_dtype == dtype


@pytest.mark.parametrize("gpu", [90, 100])
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_stochastic_rounding_needs_a_float16_state(backend, gpu, sglang_gpu):
    """sglang.sr: refused for bfloat16 / float32 on either backend; float16 on FlashInfer everywhere, on Triton only
    on SM 10.x (sglang.sr_triton_sm100), which is why the export pins --mamba-backend flashinfer."""
    base = {"mamba-backend": backend, "enable-mamba-cache-stochastic-rounding": True, "mamba-cache-philox-rounds": 10}
    for dtype in ("bfloat16", "float32"):
        _, err = sglang_resolves({"mamba-ssm-dtype": dtype, **base}, "NemotronHForCausalLM", gpu, sglang_gpu)
        assert err and FACTS["sglang.sr"].quote.format(value=repr(dtype)) in err
    _, err = sglang_resolves({"mamba-ssm-dtype": "float16", **base}, "NemotronHForCausalLM", gpu, sglang_gpu)
    if backend == "triton" and gpu != 100:
        assert err and FACTS["sglang.sr_triton_sm100"].quote in err
    else:
        assert err is None


@pytest.mark.parametrize("arch", ARCHS["gdn"] + ARCHS["kda"])
@pytest.mark.parametrize("gpu", [90, 100])
def test_replay_needs_the_triton_decode_the_export_pins(arch, gpu, sglang_gpu):
    """sglang.linear_replayssm / sglang.linear_decode: --enable-linear-replayssm with the FlashInfer decode is
    refused, and on SM 10.x a bfloat16 state makes FlashInfer the default decode where none is named (not on the
    Kimi models, whose hook defaults to Triton), so the export names Triton."""
    kind = "kda" if arch in ARCHS["kda"] else "gdn"
    t = Target.make("sglang", SGLANG_VERSION, gpu, 0, DIMS[kind], arch)
    args = sglang_args(_plan(t, Setting.parse("bf16@replay16"), kind, 0, "mtp"))
    assert args["linear-attn-decode-backend"] == "triton"
    # the radix-cache strategy aside (see test_export_rules_agree_with_sglang): the decode backend alone
    args["mamba-radix-cache-strategy"], args["disable-overlap-schedule"] = "no_buffer", True
    assert sglang_resolves(args, arch, gpu, sglang_gpu)[1] is None
    _, err = sglang_resolves({**args, "linear-attn-decode-backend": "flashinfer"}, arch, gpu, sglang_gpu)
    assert err and FACTS["sglang.linear_replayssm"].quote in err
    del args["linear-attn-decode-backend"]
    view, err = sglang_resolves(args, arch, gpu, sglang_gpu)
    if gpu == 100 and not arch.startswith("Kimi"):
        assert err and FACTS["sglang.linear_replayssm"].quote in err
    else:
        assert err is None and view.linear_attn_decode_backend in (None, "triton")


@pytest.mark.parametrize("length", [0, -1])
def test_replay_window_below_one_is_refused(length, sglang_gpu):
    """sglang.linear_replayssm: --linear-replayssm-cache-len must be >= 1; every window the export writes is."""
    args = {"mamba-ssm-dtype": "bfloat16", "linear-attn-decode-backend": "triton", "enable-linear-replayssm": True,
            "linear-replayssm-cache-len": length, "mamba-radix-cache-strategy": "no_buffer",
            "disable-overlap-schedule": True}  # fmt: skip
    _, err = sglang_resolves(args, "Qwen3_5ForCausalLM", 90, sglang_gpu)
    assert err and f"--linear-replayssm-cache-len must be >= 1, got {length}." in err
    for L in (1, 2, 8, 16, 64):
        s = Setting.parse(f"bf16@replay{L}")
        assert not violations(Target.make("sglang", SGLANG_VERSION, 90, 0, QWEN), s, "gdn")
        assert sglang_args(_plan(Target.make("sglang", SGLANG_VERSION, 90, 0, QWEN), s, "gdn", 0, "mtp"))[
            "linear-replayssm-cache-len"
        ] == L  # fmt: skip


def test_spec_verify_needs_a_chain_and_excludes_the_decode_ring(sglang_gpu):
    """sglang.linear_replayssm_spec: a tree (topk > 1) and --enable-linear-replayssm beside it are refused; unset,
    the SSM dtype becomes float32."""
    base = {"linear-attn-decode-backend": "triton", "enable-linear-replayssm-spec": True, "linear-replayssm-cache-len": 16,
            "speculative-algorithm": "NEXTN", "speculative-num-steps": 3}  # fmt: skip
    _, err = sglang_resolves(
        {**base, "speculative-eagle-topk": 4, "speculative-num-draft-tokens": 8}, "Qwen3_5ForCausalLM", 90, sglang_gpu
    )
    assert err and FACTS["sglang.linear_replayssm_spec"].quote in err
    chain = {**base, "speculative-eagle-topk": 1, "speculative-num-draft-tokens": 4}
    no_buffer = {"mamba-radix-cache-strategy": "no_buffer", "disable-overlap-schedule": True}
    _, err = sglang_resolves(
        {**chain, **no_buffer, "enable-linear-replayssm": True}, "Qwen3_5ForCausalLM", 90, sglang_gpu
    )
    assert err and "mutually exclusive" in err
    view, err = sglang_resolves(chain, "Qwen3_5ForCausalLM", 90, sglang_gpu)
    assert err is None and view.mamba_ssm_dtype == "float32"


# -- the facts quote SGLang's code ---------------------------------------------------------------------------------
def _squash(text: str) -> str:
    """Whitespace and Python's implicit string concatenation removed, so a quote matches across source lines."""
    return re.sub(r'"f?"|\'f?\'', "", re.sub(r"\s+", "", text))


def _source(path: str) -> pathlib.Path:
    return SGLANG_ROOT.parent / path.removeprefix("python/")


@pytest.mark.parametrize("fid", [f for f, x in FACTS.items() if x.engine == "sglang" and x.quote])
def test_fact_quotes_are_in_sglang_source(fid):
    f = FACTS[fid]
    if not f.holds(SGLANG_VERSION):
        pytest.skip(f"{fid}: not SGLang {SGLANG_VERSION}'s source words")
    files = [_source(x.path) for x in f.sources]
    assert all(p.exists() for p in files), (fid, [str(p) for p in files if not p.exists()])
    text = "".join(_squash(p.read_text()) for p in files)
    for part in re.split(r"\[\.\.\.\]|\{[^}]*\}", f.quote):
        if _squash(part):
            assert _squash(part) in text or _squash(part).replace('"', "'") in text, (fid, part)


def test_fact_sources_exist_in_sglang():
    """Every sglang.* fact cites files of the installed release (the unquoted ones too)."""
    for fid, f in FACTS.items():
        if f.engine == "sglang" and f.holds(SGLANG_VERSION):
            for x in f.sources:
                assert _source(x.path).exists(), (fid, x.path)
