"""Figures of the benchmark results (matplotlib, from the `bench` extra): one PNG per results JSON.

`plot(result, path)` picks the figure from the result's "benchmark" field: kernel µs per row
against the batch (gdn, mamba2), decode throughput per batch (decode), speculative capacity and
throughput (spec), prompt tokens/s against the prompt length (prefill_kernels, prefill_e2e). It returns False, drawing nothing, when matplotlib is not installed.
"""

from __future__ import annotations

KERNEL_CURVES = ("state_read", "recurrent", "buffered", "verify5")  # verify5: 4 drafts


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: dict, path: str) -> bool:
    """Write the result's figure to `path`; False when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return False
    draw = {"gdn": _kernels, "mamba2": _kernels, "decode": _decode, "spec": _spec, "prefill_kernels": _prefill_kernels,
            "prefill_e2e": _prefill_e2e}[result["benchmark"]]
    fig = draw(plt, result)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _kernels(plt, result):
    names = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    curves = (result["peer"],) + KERNEL_CURVES
    for ax, name in zip(axes[0], names):
        rows = [r for r in result["rows"] if r["shape"] == name]
        for k in curves:
            if rows and k in rows[0]["us"]:
                ax.plot([r["B"] for r in rows], [r["us"][k] / r["B"] for r in rows], marker="o", label=k)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{name} {result['benchmark']} ({result['gpu']})")
        ax.set_xlabel("batch")
        ax.set_ylabel("µs per row")
        ax.legend()
    return fig


def _title(result) -> str:
    return f"{result['preset']} ({result['gpu']}, {result['date']}, random {result['dtype']} weights)"


def _decode(plt, result):
    rows = [r for r in result["rows"] if r.get("decode_tokens_per_s")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode in sorted({r["mode"] for r in rows}):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["batch"])
        axes[0].plot([r["batch"] for r in mine], [r["decode_tokens_per_s"] for r in mine], marker="o", label=mode)
        axes[1].plot([r["batch"] for r in mine], [r["step_ms"] for r in mine], marker="o", label=mode)
    for ax, label in zip(axes, ("decode tokens / s", "median step (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(_title(result))
    return fig


def _spec(plt, result):
    rows = [r for r in result["rows"] if r.get("decode_tokens_per_s")]
    labels = list(dict.fromkeys(f"{r['setting']} a={r['alpha']}" for r in rows))
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(max(11, 1.4 * len(labels)), 4))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        mine = {f"{r['setting']} a={r['alpha']}": r for r in rows if r["mode"] == mode}
        xs = [x + (i - (len(modes) - 1) / 2) * width for x in range(len(labels))]
        axes[0].bar(xs, [mine[k]["admitted"] if k in mine else 0 for k in labels], width, label=mode)
        axes[1].bar(xs, [mine[k]["decode_tokens_per_s"] if k in mine else 0 for k in labels], width, label=mode)
    for ax, label in zip(axes, ("requests admitted", "decode tokens / s")):
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(_title(result))
    return fig


def _prefill_kernels(plt, result):
    groups = list(dict.fromkeys((r["family"], r["B"]) for r in result["rows"]))
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(5 * max(1, len(groups)), 4), squeeze=False)
    for ax, (family, B) in zip(axes[0], groups):
        rows = sorted((r for r in result["rows"] if (r["family"], r["B"]) == (family, B)), key=lambda r: r["P"])
        for op in rows[0]["tokens_per_s"]:
            ax.plot([r["P"] for r in rows], [r["tokens_per_s"][op] / 1e6 for r in rows], marker="o", label=op)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{family} prefill, B = {B} ({result['gpu']})")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("M tokens / s")
        ax.legend()
    return fig


def _prefill_e2e(plt, result):
    fig, ax = plt.subplots(figsize=(6, 4))
    for side in dict.fromkeys(r["side"] for r in result["rows"]):
        rows = sorted((r for r in result["rows"] if r["side"] == side), key=lambda r: r["P"])
        ax.plot([r["P"] for r in rows], [r["ttft_s"] * 1e3 for r in rows], marker="o", label=side)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.legend()
    fig.suptitle(f"{result['preset']} ({result['gpu']}, {result['date']}, random {result['dtype']} weights, B = 1)")
    return fig
