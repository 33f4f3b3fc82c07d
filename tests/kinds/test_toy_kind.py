"""A fourth layer kind defined only here runs through `simulate` and `analyze --synthetic` without a change to the
package: the kind (inputs, FP32 recurrence, sizes), its preset and its synthetic draw are registered from outside.

The toy kind is a gated linear attention with one decay per head and no delta rule (RetNet / GLA-like):

    S_t = a_t S_{t-1} + v_t k_t^T        y_t = S_t q_t        S: [P, N] per head (rows: value channels)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from ssmquant import kinds
from ssmquant.cli import main
from ssmquant.kinds import Checks, LayerInputs, LayerKind, Physics, expand_groups, raise_input_error, remember_valid
from ssmquant.models import synthetic
from ssmquant.models.presets import Preset, register_preset
from ssmquant.replay import emulate, parse_variants, reference_decode
from ssmquant.simulate import simulate


@dataclass
class ToyInputs(LayerInputs):
    """q, k [B, T, G, N]; v [B, T, H, P]; a [B, T, H] decays in (0, 1]; initial_state [B, H, P, N] or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    initial_state: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)

    kind = "toy"
    SEQUENCE_FIELDS = ("q", "k", "v", "a")

    batch = property(lambda self: self.v.shape[0])
    steps = property(lambda self: self.v.shape[1])
    num_heads = property(lambda self: self.v.shape[2])
    rows = property(lambda self: self.v.shape[3])
    state_dim = property(lambda self: self.k.shape[3])
    num_groups = property(lambda self: self.k.shape[2])
    device = property(lambda self: self.v.device)

    def validate(self):
        b, t, h, p = self.v.shape
        g, n = self.k.shape[2], self.k.shape[3]
        checks = Checks()
        for name, shape in (("q", (b, t, g, n)), ("k", (b, t, g, n)), ("v", (b, t, h, p)), ("a", (b, t, h))):
            checks.tensor(name, getattr(self, name), shape, self.device)
        checks.rule(lambda: ((self.a <= 0) | (self.a > 1)).any(), lambda: raise_input_error("a must lie in (0, 1]"))
        checks.run()
        remember_valid(self)
        return self


class ToyPhysics(Physics):
    def __init__(self, inputs: ToyInputs):
        heads = inputs.num_heads
        self.inputs = inputs
        self.a = inputs.a.float()
        self.q = expand_groups(inputs.q.float(), heads)
        self.k = expand_groups(inputs.k.float(), heads)
        self.v = inputs.v.float()

    def buffered(self, dtype):
        to = (lambda t: t) if dtype == torch.float32 else (lambda t: t.to(dtype).float())
        return to(self.v), to(self.k)

    def advance(self, s, t, buffered=None):
        v, k = (self.v[:, t], self.k[:, t]) if buffered is None else (buffered[0][:, t], buffered[1][:, t])
        s = self.a[:, t, :, None, None] * s + v[..., None] * k[:, :, None, :]
        return s, (s * self.q[:, t, :, None, :]).sum(-1)


class Toy(LayerKind):
    name = "toy"
    title = "toy gated linear attention"
    short = "toy"
    inputs_type = ToyInputs

    def decays(self, inputs):
        return inputs.a.float()

    def physics(self, inputs):
        return ToyPhysics(inputs)

    def reference_states(self, inputs, every=1):
        phys, state = ToyPhysics(inputs), torch.zeros(inputs.state_shape)
        for t in range(inputs.steps):
            state, _ = phys.advance(state, t)
            if (t + 1) % every == 0:
                yield t + 1, state

    def input_bytes_per_token(self, dims, act_bytes=4):
        return 4 * (2 * dims.groups * dims.state_dim + dims.heads) + act_bytes * dims.heads * dims.rows

    def emulation_bytes_per_token(self, dims, variants):
        h, r, n = dims.heads, dims.rows, dims.state_dim
        return 4 * (h + 2 * h * n + h * r + variants * (h * r + h * n))

    def ring_row(self, dims):
        return dims.heads * dims.rows + dims.groups * dims.state_dim, dims.heads

    def prefill_scan_elements(self, dims, chunk):
        return 2 * dims.heads * dims.rows * dims.state_dim / chunk

    def random_inputs(self, dims, batch, steps, *, device="cpu", seed=0):
        gen = torch.Generator().manual_seed(seed)
        g, n, h, p = dims.groups, dims.state_dim, dims.heads, dims.rows
        return _draw(batch, steps, g, n, h, p, gen).validate()


def _draw(batch, steps, g, n, h, p, gen) -> ToyInputs:
    k = torch.nn.functional.normalize(torch.randn(batch, steps, g, n, generator=gen), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(batch, steps, g, n, generator=gen), dim=-1) * n**-0.5
    v = torch.randn(batch, steps, h, p, generator=gen)
    a = 1.0 - 0.05 * torch.rand(batch, steps, h, generator=gen)
    return ToyInputs(q, k, v, a)


@dataclass(frozen=True)
class ToyShape:
    heads: int = 2
    head_dim: int = 16
    key_dim: int = 32
    key_heads: int = 1
    kind = "toy"
    pattern_char = "L"
    groups = property(lambda self: self.key_heads)
    rows = property(lambda self: self.head_dim)
    state_dim = property(lambda self: self.key_dim)
    state_heads = property(lambda self: self.heads)


def _synthetic(preset, shape, batch, steps, gen, device, dtype, sigma, profile, pgen, options):
    t = _draw(batch, steps, shape.groups, shape.state_dim, shape.heads, shape.rows, torch.Generator().manual_seed(7))
    return {"q": t.q, "k": t.k, "v": t.v.to(dtype), "a": t.a, "params": {"decay": "1 - 0.05 U(0, 1)"}}


@pytest.fixture(scope="module", autouse=True)
def toy_kind():
    """The kind, a preset of it and its synthetic draw, registered from outside the package."""
    kind = kinds.register(Toy())
    register_preset(Preset(name="toy-gla", hf_repo="nobody/toy-gla", architecture="ToyForCausalLM", model_type="toy",
                           layer_kind="toy", num_layers=3, ssm_layers=(0, 1), layer_pattern="LLF", hidden_size=64,
                           shape=ToyShape()))  # fmt: skip
    synthetic.register_draw("toy", synthetic.SyntheticDraw(_synthetic, stress_profiles=False))
    yield kind
    # the registries are the package's: the toy leaves them as it found them
    from ssmquant.kinds import base
    from ssmquant.models import presets

    base._KINDS.pop("toy")
    presets.PRESETS.pop("toy-gla")
    synthetic._DRAWS.pop("toy")


def test_simulate_runs_the_toy_kind_on_the_torch_backend():
    inp = Toy().random_inputs(kinds.LayerDims("toy", 2, 16, 32, 1), 2, 40)
    variants = parse_variants("fp32,fp8_e4m3,int8@replay8,nvfp4:sr@replay16")
    trace = simulate(inp, variants, backend="auto")  # the CPU: the torch reference
    frame = trace.to_frame()
    assert set(frame["variant"]) == {v.name for v in variants} and trace.meta["kind"] == "toy"
    last = frame[frame["step"] == 40].set_index("variant")["state_rel_err"]
    assert last["fp32@conventional"] == 0.0 and 0 < last["int8@replay8"] < 0.05 and 0 < last["fp8_e4m3@conventional"]
    # the fp32 variant equals the kind's FP32 reference, which is the recurrence written out here
    res = emulate(inp, parse_variants("fp32"), return_outputs=True)
    y, _, _ = reference_decode(inp)
    s = torch.zeros(inp.state_shape)
    for t in range(inp.steps):
        s = inp.a[:, t, :, None, None] * s + inp.v[:, t, ..., None] * expand_groups(inp.k, 2)[:, t, :, None, :]
        assert torch.equal(y[:, t], (s * expand_groups(inp.q, 2)[:, t, :, None, :]).sum(-1))
    assert torch.equal(res.outputs[0], y)


def test_simulate_refuses_the_fused_backend_for_a_kind_without_a_kernel():
    from ssmquant.simulate import BackendError

    inp = Toy().random_inputs(kinds.LayerDims("toy", 2, 16, 32, 1), 1, 4)
    with pytest.raises(BackendError, match="no fused kernel is registered for toy layers"):
        simulate(inp, ["int8"], backend="triton")  # CPU tensors: the tests run the kernels in Triton's interpreter


def test_analyze_synthetic_runs_the_toy_kind(tmp_path):
    out = tmp_path / "toy"
    res = CliRunner().invoke(main, ["analyze", "--model", "toy-gla", "--synthetic", "--steps", "48", "--batch", "2",
                                    "--formats", "fp8_e4m3,int8", "--schemes", "conventional,replay", "--buffer-len",
                                    "8", "--device", "cpu", "-q", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    summary = pd.read_csv(out / "summary.csv")
    assert sorted(summary["layer"].unique()) == [0, 1] and len(summary) == 2 * 4
    assert summary["out_rel_err"].between(0, 1).all() and math.isfinite(summary["out_rel_err"].max())
    assert {"drift.png", "heatmap.png", "heads.png", "memory.csv"} <= {p.name for p in out.iterdir()}


def test_calibrate_runs_the_toy_kind(tmp_path):
    """calibrate measures the toy kind on the torch reference and writes its recipe among research settings (issue
    43: it died in the recipe's own check of the layer kind); among the engines' settings it is refused in one line,
    since no engine serves it."""
    out = tmp_path / "recipe"
    args = ["calibrate", "--model", "toy-gla", "--synthetic", "--horizon", "48", "--batch", "2", "--heldout-batch",
            "2", "--budget", "0.05", "--device", "cpu", "-q", "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and res.output.startswith("Error: --choose-among engines: no engine serves toy layers")
    res = CliRunner().invoke(main, [*args, "--choose-among", "research"])
    assert res.exit_code == 0, res.output
    from ssmquant.calibrate.recipe import load_recipe

    recipe = load_recipe(out)
    assert recipe.layer_kind == "toy" and sorted(d.layer for d in recipe.layers) == [0, 1]


@pytest.mark.parametrize("target", ["vllm", "trtllm", "flashinfer"])
def test_export_refuses_the_toy_kind_cleanly(tmp_path, target):
    """No engine serves the toy kind: export says so in one line, never a traceback."""
    out = tmp_path / "recipe"
    res = CliRunner().invoke(main, ["calibrate", "--model", "toy-gla", "--synthetic", "--horizon", "32", "--batch", "1",
                                    "--heldout-batch", "1", "--budget", "0.05", "--candidates", "int8",
                                    "--schemes", "conventional", "--choose-among", "research", "--device", "cpu",
                                    "-q", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["export", str(out), "--target", target])
    assert res.exit_code in (1, 2) and res.output.startswith("Error:"), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception


def test_a_kind_without_a_transformers_model_says_so_when_asked_for_its_config_layout():
    """The config mapping lives behind the kind (``LayerKind.config_layout``); the toy has none."""
    with pytest.raises(kinds.KindError, match="no transformers config mapping"):
        Toy().config_layout(None)
