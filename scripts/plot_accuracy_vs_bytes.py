"""Plot evaluation accuracy after each epoch against the cumulative gradient bytes sent.

    python scripts/plot_accuracy_vs_bytes.py [RUNS_JSON] [PNG]

RUNS_JSON (default docs/compression_runs.json) is what
scripts/compare_compression.py writes: one entry per strategy with its
per-epoch ``eval_accuracy`` and cumulative ``bytes_sent`` (per rank). The
plot has one line per strategy, bytes on a log axis; needs matplotlib.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "docs", "compression_runs.json")
PNG = os.path.join(ROOT, "docs", "accuracy_vs_bytes.png")


def plot(runs_json=RUNS, png=PNG):
    """Write the plot of ``runs_json`` to ``png``; returns ``png``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(runs_json) as f:
        doc = json.load(f)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for run in doc["runs"]:
        epochs = run["epochs"]
        ax.plot([e["bytes_sent"] for e in epochs], [100 * e["eval_accuracy"] for e in epochs],
                marker="o", markersize=3, label="%s (%.2f %%)"
                % (run["name"], 100 * epochs[-1]["eval_accuracy"]))
    ax.set_xscale("log")
    ax.set_xlabel("gradient bytes sent per rank, cumulative (log scale)")
    ax.set_ylabel("evaluation accuracy after the epoch (%)")
    ax.set_ylim(max(0, ax.get_ylim()[0]), 100)
    ax.set_title("MNIST CNN, %d ranks, %d epochs, %d training images"
                 % (doc["workers"], doc["epochs"], doc["train_images"]))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return png


if __name__ == "__main__":
    print(plot(*sys.argv[1:3]))
