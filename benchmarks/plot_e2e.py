"""Plot bench_e2e.py results: decode throughput per batch (both modes) and speculative capacity and
throughput per draft count. Usage: python3 benchmarks/plot_e2e.py RESULT.json [...] (writes RESULT.png).

Needs matplotlib (not a kvbuffer dependency); bench_e2e.py calls `plot` itself when it is installed.
"""

from __future__ import annotations

import json
import sys


def plot(result: dict, path: str) -> bool:
    """Write one PNG for a decode or spec result; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["rows"] if r.get("decode_tokens_per_s")]
    modes = sorted({r["mode"] for r in rows})
    title = f"{result['preset']} ({result['gpu']}, {result['date']}, random {result['dtype']} weights)"
    if result["what"] == "decode":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for mode in modes:
            mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["batch"])
            axes[0].plot([r["batch"] for r in mine], [r["decode_tokens_per_s"] for r in mine], marker="o", label=mode)
            axes[1].plot([r["batch"] for r in mine], [r["step_ms"] for r in mine], marker="o", label=mode)
        for ax, label in zip(axes, ("decode tokens / s", "median step (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_ylabel(label)
            ax.legend()
    else:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        drafts = sorted({r["draft_tokens"] for r in rows})
        width = 0.8 / max(1, len(modes))
        for i, mode in enumerate(modes):
            mine = {r["draft_tokens"]: r for r in rows if r["mode"] == mode}
            xs = [d + (i - (len(modes) - 1) / 2) * width for d in range(len(drafts))]
            axes[0].bar(xs, [mine[d]["admitted"] if d in mine else 0 for d in drafts], width, label=mode)
            axes[1].bar(xs, [mine[d]["decode_tokens_per_s"] if d in mine else 0 for d in drafts], width, label=mode)
        budget = result["args"].get("memory_budget")
        for ax, label in zip(axes, (f"requests admitted ({budget} GiB for caches)", "decode tokens / s")):
            ax.set_xticks(range(len(drafts)), [f"{d} drafts" for d in drafts])
            ax.set_ylabel(label)
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        out = path.removesuffix(".json") + ".png"
        if not plot(result, out):
            print("matplotlib is not installed: pip install matplotlib", file=sys.stderr)
            return 1
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
