"""`analyze --prompt`: the prompt's tokens are captured besides the decode steps, replay's first checkpoint holds the
prompt's stored state (with an fp32 buffer, an error before the first flush, which an empty start never has);
report.json records the prompt."""

import pytest
from click.testing import CliRunner

from ssmquant.analysis import AnalyzeConfig, AnalyzeError, analyze
from ssmquant.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _run(prompt):
    cfg = AnalyzeConfig(model="tiny-nemotron", steps=32, prompt=prompt, batch=1, layers=[0], formats=["int8"],
                        schemes=["replay16:fp32"], record_every=8, device="cpu")  # fmt: skip
    return analyze(cfg)


def test_replay_after_a_prompt_starts_from_the_stored_checkpoint():
    with_prompt, without = _run(48), _run(0)
    first = lambda r: r.traces[r.traces.step == 8].state_rel_err_max.iloc[0]  # noqa: E731 (steps 1-8: no flush yet)
    assert first(without) == 0.0 and first(with_prompt) > 0.0
    doc = with_prompt.report()
    assert doc["settings"]["prompt"] == 48 and doc["prompt"]["tokens"] == 48 and "prefilled" in doc["prompt"]["note"]
    assert without.report()["prompt"]["tokens"] == 0
    assert int(with_prompt.traces.step.max()) == 32  # decode steps after the prompt


def test_a_negative_prompt_is_one_line():
    with pytest.raises(AnalyzeError, match="--prompt must be a whole number"):
        analyze(AnalyzeConfig(model="tiny-nemotron", steps=8, prompt=-1))
    res = CliRunner().invoke(main, ["analyze", "--model", "tiny-nemotron", "--prompt", "-5", "--out", "x"])
    assert res.exit_code == 2 and "--prompt" in res.output and "Traceback" not in res.output


def test_the_memory_estimate_holds_the_prompt_but_emulates_only_the_decode_steps():
    import torch

    from ssmquant.kinds import LayerDims
    from ssmquant.sizing import analyze_memory

    dims = LayerDims("mamba2", heads=64, rows=64, state_dim=128, groups=8)
    kw = dict(batch=8, steps=512, variants=6, recorded=32, device=torch.device("cpu"), backend="torch")
    plain, prompted = analyze_memory(dims, **kw), analyze_memory(dims, prompt=8192, **kw)
    assert prompted.total("host") > plain.total("host")
    # the inputs grow with the prompt (8704 / 512 tokens); the torch emulation's copies do not
    grow = prompted.total("host") - plain.total("host")
    inputs = 8 * 8192 * (64 * 64 * 4 + 2 * 8 * 128 * 4 + 4 * 64)
    assert grow == inputs, (grow, inputs)
