"""Issue #14's ">= 10x compiled" verdict for KDA from one run of benchmarks/gpu/kda_speed.sh, against the fastest
compiled peer measured anywhere in that run.

Reads the bench's JSON (`bench_emulation.py --json`: every variant's kernel timing and its compiled peers) and the
fresh-process peer's JSON (`kda_peer.py`: fp8_e4m3 conventional compiled again alone, three ways). For every
variant the peer is the fastest median among all its measurements (bench: default and reduce-overhead; for the
fresh-process variant also its three): the peer at its best, whichever process or compile produced it. Prints
and writes (JSON) per variant: the kernel's median with its spread, every peer measurement, the ratio to the
fastest peer with its range (the kernel's slowest run over that peer's fastest run .. the kernel's fastest over the
peer's slowest), the bar met or not by the median ratio and by the range's low end, and the spread between the
peer measurements (fastest / slowest median) so a peer that still varies between processes shows. Reads only JSON
(no torch): it runs in a second.

    python benchmarks/gpu/kda_verdict.py --bench BENCH.json --peer PEER.json --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

BAR = 10.0  # the ">= 10x compiled"
LOW_END = "bar met at the range's low end"


def verdict(bench: dict, peer: dict | None) -> list[dict]:
    """One entry per KDA variant of the bench that has at least one compiled peer measurement."""
    out = []
    for v in bench["variants"]:
        if v["layer"] != "kda":
            continue
        peers = [(f"bench {mode}", m) for mode, m in v["compiled peers"].items() if m is not None]
        if peer is not None and peer["variant"] == v["variant"]:
            peers += [(f"fresh process: {label}", m) for label, m in peer["measurements"].items() if m is not None]
        if not peers:
            continue
        kernel = sorted(v["kernel G/s (runs)"])
        k_med = kernel[len(kernel) // 2] if len(kernel) % 2 else sum(kernel[len(kernel) // 2 - 1 : len(kernel) // 2 + 1]) / 2
        best_label, best = max(peers, key=lambda p: p[1]["G/s"])
        medians = [m["G/s"] for _, m in peers]
        ratio = k_med / best["G/s"]
        low, high = kernel[0] / max(best["G/s (runs)"]), kernel[-1] / min(best["G/s (runs)"])
        out.append(
            {
                "variant": v["variant"],
                "kernel G/s": k_med,
                "kernel G/s (slowest, fastest)": [kernel[0], kernel[-1]],
                "peers (G/s median, slowest-fastest, host us/step, device busy us/step)": {
                    label: [
                        round(m["G/s"], 1),
                        m["G/s (slowest-fastest)"],
                        round(m["host us per step (first steps)"], 1),
                        None if m.get("profile") is None else round(m["profile"].get("busy us per step", float("nan")), 1),
                    ]
                    for label, m in peers
                },
                "fastest peer": best_label,
                "fastest peer G/s": best["G/s"],
                "x fastest peer": ratio,
                "x fastest peer (range)": [low, high],
                "bar met (median ratio >= 10)": ratio >= BAR,
                LOW_END: low >= BAR,
                "peer medians fastest / slowest": max(medians) / min(medians),
            }
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", required=True, help="bench_emulation.py --json output")
    ap.add_argument("--peer", help="kda_peer.py output (optional: without it, the bench's peers alone)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    bench = json.loads(pathlib.Path(args.bench).read_text())
    peer = json.loads(pathlib.Path(args.peer).read_text()) if args.peer and pathlib.Path(args.peer).exists() else None
    if args.peer and peer is None:
        print(f"kda_verdict: {args.peer} is missing: the bench's peers alone", flush=True)
    rows = verdict(bench, peer)
    if not rows:
        sys.exit("kda_verdict: no KDA variant with a compiled peer in the bench's JSON")
    for r in rows:
        print(
            f"VERDICT {r['variant']}: kernel {r['kernel G/s']:.1f} G/s "
            f"({r['kernel G/s (slowest, fastest)'][0]:.1f}-{r['kernel G/s (slowest, fastest)'][1]:.1f}), "
            f"fastest peer {r['fastest peer G/s']:.1f} G/s ({r['fastest peer']}) -> {r['x fastest peer']:.1f}x "
            f"({r['x fastest peer (range)'][0]:.1f}-{r['x fastest peer (range)'][1]:.1f}); bar "
            f"{'MET' if r['bar met (median ratio >= 10)'] else 'NOT met'} by the median, "
            f"{'met' if r[LOW_END] else 'not met'} at the range's low end; "
            f"peer medians differ {r['peer medians fastest / slowest']:.2f}x",
            flush=True,
        )
        for label, m in r["peers (G/s median, slowest-fastest, host us/step, device busy us/step)"].items():
            print(f"    {label}: {m[0]} G/s ({m[1]}), host {m[2]} us/step, device busy {m[3]} us/step", flush=True)
    pathlib.Path(args.out).write_text(json.dumps({"bar": BAR, "variants": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
