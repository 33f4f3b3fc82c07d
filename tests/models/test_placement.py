"""Placing a model over devices (models.placement) and building random-weight models in memory
(models.build.build_random_model): plans with fake device lists, the refusal of a model that does not fit,
and the in-memory weights against transformers' own initialisation, bit for bit."""

import pytest
import torch
import transformers

from ssmquant.models.build import (
    BuildError,
    _config_object,
    _meta_model,
    build_random_model,
    estimate_parameters,
    parse_devices,
    preset_config,
)
from ssmquant.models.placement import Unit, balanced_plan, model_units, plan_loads
from ssmquant.models.presets import get_preset
from ssmquant.sizing import GIB, SizingError

SMALL = {
    "nemotron-h-8b": {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "mamba_num_heads": 8},
    "qwen3.5-0.8b": {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256},
}


def units(n_layers, layer=GIB, head=GIB // 2, tail=GIB // 4):
    return [
        Unit("embed", head, "head"),
        *[Unit(f"layers.{i}", layer, "layer", i) for i in range(n_layers)],
        Unit("norm", 1, "tail"),
        Unit("lm_head", tail, "tail"),
    ]


def test_plan_is_contiguous_balanced_and_keeps_heads_first_tails_last():
    u = units(48)
    plan = balanced_plan(u, {"cuda:0": 40 * GIB, "cuda:1": 40 * GIB})
    assert list(plan) == [x.name for x in u]  # forward order
    assert plan["embed"] == "cuda:0" and plan["norm"] == plan["lm_head"] == "cuda:1"
    devs = [plan[f"layers.{i}"] for i in range(48)]
    assert devs == sorted(devs)  # one contiguous run per device: a forward crosses the boundary once
    loads = plan_loads(plan, u)
    assert abs(loads["cuda:0"] - loads["cuda:1"]) <= GIB  # within one layer
    assert sum(loads.values()) == sum(x.nbytes for x in u)


def test_plan_follows_unequal_room_and_three_devices():
    u = units(30, head=0, tail=0)
    plan = balanced_plan(u, {"cuda:0": 11 * GIB, "cuda:1": 21 * GIB})
    assert sum(plan[f"layers.{i}"] == "cuda:0" for i in range(30)) == 10
    plan3 = balanced_plan(u, {"a": 40 * GIB, "b": 40 * GIB, "c": 40 * GIB})
    assert [sum(v == d for v in plan3.values()) for d in "abc"] == [10 + 1, 10, 10 + 2]  # + embed / + norm, lm_head


def test_plan_refuses_a_model_that_does_not_fit_naming_the_estimate():
    with pytest.raises(SizingError, match=r"needs about 48\.8 GiB of weights .* have 40\.0 GiB of room .*use more GPUs"):
        balanced_plan(units(48), {"cuda:0": 20 * GIB, "cuda:1": 20 * GIB})
    # enough room in total, but the head block alone exceeds the first device's share
    big_head = [Unit("embed", 30 * GIB, "head"), Unit("layers.0", GIB, "layer", 0), Unit("layers.1", GIB, "layer", 1)]
    with pytest.raises(SizingError, match="no contiguous split"):
        balanced_plan(big_head, {"cuda:0": 20 * GIB, "cuda:1": 20 * GIB})


def test_units_of_real_families_in_forward_order():
    for name in SMALL:
        p = get_preset(name)
        model = _meta_model(p, _config_object(p, preset_config(p, num_layers=4, overrides=SMALL[name])))
        u = model_units(model)
        roles = [x.role for x in u]
        assert roles == sorted(roles, key=["head", "layer", "tail"].index)
        assert [x.index for x in u if x.role == "layer"] == [0, 1, 2, 3]
        tensors = [*model.parameters(), *model.buffers()]  # non-persistent buffers (rotary tables) too
        assert sum(x.nbytes for x in u) == sum(t.numel() * t.element_size() for t in tensors)
    names = [x.name for x in u]  # qwen3.5: vision tower and rotary table run before the stack, norm before lm_head
    assert names[:3] == ["model.visual", "model.language_model.embed_tokens", "model.language_model.rotary_emb"]
    assert names[-2:] == ["model.language_model.norm", "lm_head"]


@pytest.mark.parametrize("name", list(SMALL))
def test_in_memory_weights_are_transformers_init_bit_for_bit(name):
    m = build_random_model(name, devices="cpu", dtype="float32", num_layers=4, overrides=SMALL[name], seed=3,
                           free=lambda d: 64 * GIB, progress=lambda s: None)  # fmt: skip
    p = get_preset(name)
    ref = getattr(transformers, p.architecture)._from_config(
        _config_object(p, preset_config(p, num_layers=4, overrides=SMALL[name])), dtype=torch.float32
    )
    for t in [*ref.modules(), *ref.parameters(), *ref.buffers()]:
        t.__dict__.pop("_is_hf_initialized", None)  # re-run the family's init from the same seed
    torch.manual_seed(3)
    ref.initialize_weights()
    got, want = m.model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k  # parameters and buffers (rotary tables) alike
    assert m.source.kind == "memory" and m.arch.architecture == p.architecture
    assert m.tokenizer("ab")["input_ids"] == [ord("a") + 3, ord("b") + 3]


def test_120b_preset_has_its_published_size_and_is_refused_before_allocation():
    n = estimate_parameters("qwen3.5-122b-a10b")
    assert 121e9 < n < 123e9  # 122B total with the published expert widths (PUBLISHED_EXTRA_FIELDS)
    with pytest.raises(SizingError, match=r"needs about 226\.\d GiB of weights .* 92\.0 GiB of room"):
        build_random_model("qwen3.5-122b-a10b", devices="cpu", free=lambda d: 100 * GIB, progress=lambda s: None)


def test_nano_preset_has_its_published_size():
    # 31.6 B total of Nemotron-3-Nano-30B-A3B: 128 experts of 1856 and a shared one of 3712 (PUBLISHED_EXTRA_FIELDS);
    # transformers' NemotronHConfig defaults alone gave 10.3 B
    n = estimate_parameters("nemotron-3-nano")
    assert 31.5e9 < n < 31.7e9


def test_parse_devices_names_bad_entries():
    assert parse_devices("cpu") == ["cpu"]
    with pytest.raises(BuildError, match="listed twice"):
        parse_devices("cpu,cpu")
    with pytest.raises(BuildError, match="unknown device 'tpu:0'; accepted: cpu, cuda:N"):
        parse_devices(["tpu:0"])
    if torch.cuda.device_count() < 8:
        with pytest.raises(BuildError, match="does not exist here"):
            parse_devices("cuda:7")


def test_auto_micro_batch_reads_the_least_free_device_of_a_spread_model():
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from ssmquant.models.capture import auto_micro_batch, prefill_bytes_per_sequence

    with torch.device("meta"):
        net = NemotronHForCausalLM(NemotronHConfig(num_hidden_layers=1, hybrid_override_pattern="M"))
    per_seq = prefill_bytes_per_sequence(net, 2048)
    # the prefill starts on cpu (the embeddings) but the layers sit on "meta": its free memory counts
    free = {"cpu": 100 * per_seq, "meta": 4 * per_seq}
    assert auto_micro_batch(net, 8, 2048, torch.device("cpu"), free=lambda d: free[d.type]) == 2


def test_capture_through_accelerate_hooks_is_unchanged():
    """The hooks that move hidden states between devices (forced here on one CPU) change nothing captured."""
    from ssmquant.models.build import dispatch
    from ssmquant.models.capture import capture_all

    m = build_random_model("nemotron-h-8b", devices="cpu", dtype="float32", num_layers=4, overrides=SMALL["nemotron-h-8b"],
                           free=lambda d: 64 * GIB, progress=lambda s: None)  # fmt: skip
    ids = torch.randint(3, 259, (2, 12))
    before = capture_all(m, ids)
    dispatch(m.model, m.model.hf_device_map, force_hooks=True)
    assert hasattr(m.model.model.layers[0], "_hf_hook")  # the hooks are in place
    after = capture_all(m, ids)
    assert sorted(before) == sorted(after) == [0, 2]
    for i in before:
        for name in ("x", "dt", "B", "C"):
            assert torch.equal(getattr(before[i], name), getattr(after[i], name))


def test_checkpoint_plan_spreads_a_saved_checkpoint_over_the_named_devices(nemotron_dir):
    """`--devices cuda:0,cuda:1` on a checkpoint: a device_map from its config alone (meta device), the
    decoder layers cut in two contiguous runs, embeddings first, LM head last; refused when it cannot fit."""
    from ssmquant.models.loading import checkpoint_plan
    from ssmquant.sizing import SizingError

    plan = checkpoint_plan(nemotron_dir, ["cuda:0", "cuda:1"], headroom_gib=0, free=lambda d: 2**30)
    layers = [dev for name, dev in plan.items() if ".layers." in name]
    assert set(layers) == {"cuda:0", "cuda:1"} and layers == sorted(layers)  # contiguous: all cuda:0, then cuda:1
    assert plan["model.embeddings"] == "cuda:0" and plan["lm_head"] == "cuda:1"
    with pytest.raises(SizingError, match=r"needs about .* GiB of weights but the 2 device\(s\) cuda:0, cuda:1"):
        checkpoint_plan(nemotron_dir, ["cuda:0", "cuda:1"], headroom_gib=0, free=lambda d: 1000)
