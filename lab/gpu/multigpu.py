"""Several GPUs: one analysis with its emulation on 1 vs 2 GPUs, and a model larger than one GPU built in memory.

Driven by lab/gpu/multigpu.sh (which sets the sizes and time limits); callable alone:

  python3 lab/gpu/multigpu.py a --model CKPT_DIR --out a.json [--steps 2048 --batch 8]
      load CKPT_DIR on cuda:0, then analyze with emulation on cuda:0 and on cuda:0 + cuda:1 (captured
      inputs), then the same preset's synthetic inputs on 1 and 2 GPUs (emulation alone, no capture);
  python3 lab/gpu/multigpu.py b --preset qwen3.5-122b-a10b --out b.json [--steps 1024 --batch 4]
      build the preset in memory over both GPUs (models.build.build_random_model), analyze with emulation on
      the GPU that holds each layer, then with emulation on cuda:0 only.

Every run's stage times and peak memory per GPU go to the JSON as soon as the run ends (a run cut short by
the time limit leaves the earlier ones). A run is skipped when the time left (--budget) is shorter than the
previous run took.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ssmquant.analysis import AnalyzeConfig, analyze

T0 = time.time()
FORMATS = ["fp8_e4m3", "int8", "nvfp4"]
SCHEMES = ["conventional", "replay"]


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f} s] {msg}", flush=True)


def gpus() -> list[torch.device]:
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def memory() -> dict:
    return {
        str(d): {
            "allocated_GiB": round(torch.cuda.memory_allocated(d) / 2**30, 2),
            "peak_GiB": round(torch.cuda.max_memory_allocated(d) / 2**30, 2),
            "free_GiB": round(torch.cuda.mem_get_info(d)[0] / 2**30, 2),
        }
        for d in gpus()
    }


def reset_peaks() -> None:
    for d in gpus():
        torch.cuda.reset_peak_memory_stats(d)


class Recorder:
    def __init__(self, path: str, part: str, budget: float):
        self.path, self.budget = Path(path), budget
        self.doc = {
            "part": part,
            "torch": torch.__version__,
            "gpus": [torch.cuda.get_device_name(d) for d in gpus()],
            "runs": [],
        }
        try:
            import transformers
            import triton

            self.doc["transformers"], self.doc["triton"] = transformers.__version__, triton.__version__
        except ImportError:
            pass
        self.last = 0.0
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.doc, indent=2) + "\n")

    def time_left(self) -> float:
        return self.budget - (time.time() - T0)

    def run(self, name: str, cfg: AnalyzeConfig, model=None, optional: bool = True, expect: float | None = None):
        """Run and record one analysis; an optional one is skipped when less time is left than ``expect``
        seconds (default: what the previous run took). Returns the record (None when skipped)."""
        expect = self.last if expect is None else expect
        if optional and self.time_left() < 1.1 * expect:
            log(f"skip {name}: {self.time_left():.0f} s left, it should take about {expect:.0f} s")
            self.doc["runs"].append({"name": name, "skipped": "time limit"})
            self.write()
            return None
        log(f"run {name}: {cfg.steps} steps x batch {cfg.batch}, emulation on {cfg.devices or cfg.device}")
        reset_peaks()
        t = time.time()
        res = analyze(cfg, model=model, notify=lambda line: log("  " + line))
        wall = time.time() - t
        self.last = wall
        rec = {
            "name": name,
            "model": res.source.get("model"),
            "layers": len(res.source["layers"]),
            "variants": int(res.summary["variant"].nunique()),
            "steps": cfg.steps,
            "batch": cfg.batch,
            "emulation_devices": cfg.devices or cfg.device,
            "wall_s": round(wall, 2),
            "elapsed_s": round(res.elapsed_s, 2),
            "stages": res.stages,
            "memory_after": memory(),
            # state-element-steps per second over the layers' wall time (capture included), all variants counted
            "layers_G_state_element_steps_per_s": round(
                len(res.source["layers"]) * res.summary["variant"].nunique() * cfg.steps * cfg.batch
                * int(torch.tensor(res.source["state_shape"]).prod()) / max(res.stages["layers_wall_s"], 1e-9) / 1e9,
                1,
            ),
            "worst_out_rel_err": float(res.summary["out_rel_err"].max()),
        }  # fmt: skip
        self.doc["runs"].append(rec)
        self.write()
        log(f"  done in {wall:.1f} s: {json.dumps(res.stages)}")
        return rec


def part_a(args) -> None:
    from ssmquant.models import load_model

    rec = Recorder(args.out, "a", args.budget)
    two = ",".join(str(d) for d in gpus()[:2]) if len(gpus()) >= 2 else None
    one = args.device
    log(f"load {args.model} on {one}")
    t = time.time()
    loaded = load_model(args.model, device=one)
    rec.doc["load_s"] = round(time.time() - t, 2)
    rec.doc["model_memory"] = memory()
    log(f"  loaded in {rec.doc['load_s']} s")
    preset = args.preset
    common = dict(formats=FORMATS, schemes=SCHEMES, device=one, backend=args.backend)
    # warm the kernel cache on every device (compiles or loads from disk) so that 1 vs 2 GPUs compare warm
    warm = AnalyzeConfig(model=preset, synthetic=True, steps=64, batch=args.batch, layers=args.warm_layers,
                         devices=two or one, **common)  # fmt: skip
    if args.warm_layers:
        rec.run("warm-up (synthetic, 2 layers)", warm, optional=False)
    cap = dict(model=str(args.model), steps=args.steps, batch=args.batch, **common)
    c1 = rec.run("captured, emulation on 1 GPU", AnalyzeConfig(devices=one, **cap), model=loaded, optional=False)
    c2 = None
    if two:
        c2 = rec.run("captured, emulation on 2 GPUs", AnalyzeConfig(devices=two, **cap), model=loaded, optional=False)
    if not args.synthetic:
        log("part a done (no synthetic runs)")
        return
    syn = dict(model=preset, synthetic=True, steps=args.steps, batch=args.batch, **common)
    # emulation alone (inputs drawn on the GPU, no capture): expected about the captured runs' emulation time
    if two:
        busy = max((c2 or {}).get("stages", {}).get("busy_s_per_device", {"": 60.0}).values())
        rec.run("synthetic, emulation on 2 GPUs", AnalyzeConfig(devices=two, **syn), expect=busy + 5)
    rec.run("synthetic, emulation on 1 GPU", AnalyzeConfig(devices=one, **syn),
            expect=(c1 or {}).get("stages", {}).get("emulate_s", 60.0) + 5)  # fmt: skip
    log("part a done")


def part_b(args) -> None:
    from ssmquant.models.build import build_random_model

    rec = Recorder(args.out, "b", args.budget)
    devices = args.devices or ",".join(str(d) for d in gpus())
    log(f"build {args.preset} in memory over {devices}")
    t = time.time()
    overrides = json.loads(args.overrides) if args.overrides else None
    loaded = build_random_model(args.preset, devices=devices, dtype=args.dtype, num_layers=args.layers,
                                overrides=overrides, headroom_gib=args.headroom_gib, progress=log)  # fmt: skip
    rec.doc["build_s"] = round(time.time() - t, 2)
    rec.doc["parameters"] = sum(p.numel() for p in loaded.model.parameters())
    rec.doc["device_map_counts"] = {
        d: sum(v == d for v in loaded.model.hf_device_map.values()) for d in dict.fromkeys(loaded.model.hf_device_map.values())
    }
    rec.doc["model_memory"] = memory()
    rec.write()
    log(f"  built in {rec.doc['build_s']} s; {json.dumps(rec.doc['model_memory'])}")
    first = devices.split(",")[0]
    common = dict(formats=FORMATS, schemes=SCHEMES, backend=args.backend, steps=args.steps, batch=args.batch)
    warm = AnalyzeConfig(model=args.preset, synthetic=True, layers=args.warm_layers, device=first, devices=devices,
                         **{**common, "steps": 64})  # fmt: skip
    if args.warm_layers:
        rec.run("warm-up (synthetic, 2 layers)", warm, optional=False)
    cap = dict(model=args.preset, device=first, **common)
    rec.run("captured, emulation on the GPU holding each layer", AnalyzeConfig(devices=devices, **cap), model=loaded,
            optional=False)  # fmt: skip
    done = rec.doc["runs"][-1]["stages"]
    rec.run(f"captured, emulation on {first} only", AnalyzeConfig(devices=first, **cap), model=loaded,
            expect=done["capture_wait_s"] + done["emulate_s"] + 5)  # fmt: skip
    log("part b done")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["a", "b"])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--model", help="part a: the checkpoint directory (or shipped model) to load")
    ap.add_argument("--preset", default="nemotron-h-8b", help="part a: the preset of the synthetic runs; part b: what to build")
    ap.add_argument("--device", default="cuda:0", help="part a: where the model loads and what '1 GPU' means")
    ap.add_argument("--devices", default=None, help="part b: the devices to build over (default: every GPU)")
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=None, help="part b: keep the first N decoder layers (checks)")
    ap.add_argument("--overrides", default=None, help="part b: config fields as JSON (checks)")
    ap.add_argument("--headroom-gib", type=float, default=8.0)
    ap.add_argument("--warm-layers", default="0,2", help="SSM layers of the warm-up run ('none': no warm-up)")
    ap.add_argument("--no-synthetic", dest="synthetic", action="store_false", help="part a: skip the synthetic runs")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; optional runs are skipped past it")
    args = ap.parse_args()
    args.warm_layers = [] if args.warm_layers == "none" else [int(x) for x in args.warm_layers.split(",")]
    (part_a if args.part == "a" else part_b)(args)


if __name__ == "__main__":
    main()
