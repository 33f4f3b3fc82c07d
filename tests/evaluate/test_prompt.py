"""`evaluate` with a prompt: one prefill forward, each variant's states stored once, then decoding.

Oracles: the model's own full forward (the teacher-forced decode after a prefill computes the same logits) and
the first decode step done by hand (prefill, every SSM state stored with ``fmt.fake_quant`` at stream 2^32 - 1, one
token), whose KL against the reference's must be eval's first position, to float64 rounding.
"""

from __future__ import annotations

import pytest
import torch

from ssmquant import formats
from ssmquant.evaluate import EvalConfig, TeacherForced, evaluate
from ssmquant.evaluate.states import layer_seed, ssm_layers, to_rows
from ssmquant.models.text import calibration_batch

PROMPT, STEPS = 24, 16


@pytest.mark.parametrize("model", ["nemotron", "qwen"])
def test_decoding_after_a_prefill_is_the_full_forward(model, request):
    loaded = request.getfixturevalue(model)
    ids = calibration_batch(2, PROMPT + STEPS + 1, tokenizer=loaded.tokenizer, split="heldout")
    with torch.inference_mode():
        full = loaded.model(input_ids=ids).logits[:, PROMPT : PROMPT + STEPS].float()
        run = TeacherForced(loaded.model, ids, prompt=PROMPT)
        run.prefill()
        steps = torch.stack([run.step(t) for t in range(STEPS)], 1)
    assert float((steps - full).norm() / full.norm()) < 1e-4
    with pytest.raises(RuntimeError, match="prefill runs once"):
        run.prefill()


def test_the_prompt_state_is_stored_before_the_first_decode_step(nemotron):
    names = ["fp32", "nvfp4@conventional", "int8@replay16"]
    r = evaluate(EvalConfig(nemotron, names, steps=STEPS, batch=2, seed=0, prompt=PROMPT))
    pos = r.positions.set_index(["variant", "position"]).kl
    assert (pos["fp32@conventional"] == 0).all()
    # without a prompt position 1 comes before any store (test_evaluate.py); after one, the stored prompt state
    # shows at once, under both schemes (replay: the prompt's state is its first checkpoint)
    assert pos["nvfp4@conventional"].loc[1] > 0 and pos["int8@replay16"].loc[1] > 0
    assert list(r.summary.writes_per_seq) == [STEPS, STEPS, 1]  # decode steps' writes; the prompt's not counted
    doc = r.report()
    assert doc["settings"]["prompt"] == PROMPT and "prefilled" in doc["emulation"]["prompt"]


def test_first_position_after_a_prompt_by_hand(nemotron):
    name, seed = "int8:sr@conventional", 5
    r = evaluate(EvalConfig(nemotron, [name], steps=4, batch=2, seed=seed, prompt=PROMPT))
    fmt = formats.parse("int8:sr")
    ids = calibration_batch(2, PROMPT + 5, tokenizer=nemotron.tokenizer, seed=seed, split="heldout")
    with torch.inference_mode():
        ref = TeacherForced(nemotron.model, ids, prompt=PROMPT)
        ref.prefill()
        var = TeacherForced(nemotron.model, ids, prompt=PROMPT)
        var.prefill()
        for layer in ssm_layers(nemotron.model):
            rows = to_rows(var.cache.get_recurrent_state(layer.index), layer.kind)
            rows.copy_(fmt.fake_quant(rows, seed=layer_seed(seed, layer.index), stream=2**32 - 1))
        p, q = ref.step(0).double().log_softmax(-1), var.step(0).double().log_softmax(-1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    got = float(r.positions[r.positions.position == 1].kl.iloc[0])
    assert kl > 0 and got == pytest.approx(kl, rel=1e-9, abs=1e-15)


def test_a_negative_prompt_is_refused(nemotron):
    from ssmquant.evaluate import EvalError

    with pytest.raises(EvalError, match="prompt"):
        evaluate(EvalConfig(nemotron, ["int8"], steps=4, batch=1, prompt=-3))


def test_the_prompts_prefill_is_in_the_memory_check(monkeypatch):
    """The decode mode prefills the prompt in one forward of the whole batch: its activations, its logits and, where
    they are materialised, one attention layer's [batch, heads, P, P] scores (tiny-kda on the CPU: 8 x 4 x 8192^2 x
    12 bytes, 25.8 GB, the run that was killed for memory) count in the estimate, and a refusal names the scores.
    Without a prompt the same run fits."""
    from ssmquant.evaluate import EvalError
    from ssmquant.evaluate import run as run_module

    class MemoryChecked(Exception):
        """Raised by the first step after the memory check: the check passed."""

    def checked(*args, **kwargs):
        raise MemoryChecked

    monkeypatch.setattr(run_module, "free_bytes", lambda device: 20 * 10**9)
    monkeypatch.setattr(run_module, "calibration_batch", checked)
    kw = dict(steps=4096, batch=8, device="cpu", mode="decode", text_split="all")  # the held-out split is too short
    with pytest.raises(EvalError, match=r"largest parts: attention scores of the prompt's prefill .* lower --prompt"):
        evaluate(EvalConfig("tiny-kda", ["int8"], prompt=8192, **kw))
    with pytest.raises(MemoryChecked):
        evaluate(EvalConfig("tiny-kda", ["int8"], prompt=0, **kw))
