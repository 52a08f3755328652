"""Train the MNIST example with each communication saving and compare them.

    python scripts/compare_compression.py            # 2 ranks x 10 epochs, six runs

Runs ``examples/mnist_train.py`` under ``mpiexec -n WORKERS`` once per
strategy (plain, fp16, bf16, top-K 1 % and threshold with error feedback,
partial 10 %), on the shipped 5,000 digits with the example's defaults and
seed, and writes into ``--out`` (default docs/):

- ``compression_runs.json``: per run its command and the per-epoch log
  (loss, accuracies, images per second, cumulative bytes sent and seconds
  blocked on communication, per rank);
- ``compression_runs.md``: the table (final evaluation accuracy, bytes sent
  per rank, their share of plain's, time);
- ``accuracy_vs_bytes.png``: evaluation accuracy after each epoch against
  the cumulative bytes sent (scripts/plot_accuracy_vs_bytes.py; matplotlib).

Accuracies and bytes are deterministic given the seed and the number of
ranks; times depend on the machine's load.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)
import plot_accuracy_vs_bytes  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "mnist_train.py")
# Threshold 0.03 (on |gradient + residual|, gradients of the mean loss over a rank's batch)
# sends the same order of bytes as top-K 1 % (4,311 of 431,080 values per step): measured on
# this CNN, about 3 times as many pairs in the first epoch, when gradients are large, about
# as many in the second, fewer later; 0.01 sends 4 to 10 times top-K's bytes in the first
# two epochs and 0.002 about 35 times in the first steps.
RUNS = [("plain", ["--compression", "none"]),
        ("fp16", ["--compression", "fp16"]),
        ("bf16", ["--compression", "bf16"]),
        ("top-K 1 %", ["--compression", "topk", "--ratio", "0.01"]),
        ("threshold 0.03", ["--compression", "threshold", "--threshold", "0.03"]),
        ("partial 10 %", ["--compression", "partial", "--ratio", "0.1"])]


def mpiexec():
    """The mpiexec of the MPI library this Python's mpi4py loads, with the
    arguments it needs (commlib.startup.mpi_library.choose_mpiexec)."""
    from commlib import errors
    from commlib.startup import mpi_library
    try:
        chosen = mpi_library.choose_mpiexec()
    except errors.CommlibError as exc:
        raise SystemExit("compare_compression.py: %s" % exc)
    return [chosen.path, *mpi_library.extra_args(chosen)]


def train(name, extra, args, scratch):
    """Run one training; returns its JSON log with ``name`` and ``command`` added."""
    log = os.path.join(scratch, "run.json")
    cmd = [*mpiexec(), "-n", str(args.workers), sys.executable, EXAMPLE, "--device", "cpu",
           "--epochs", str(args.epochs), "--json", log, *extra, *args.train_args]
    shown = ["mpiexec", "-n", str(args.workers), "python", "examples/mnist_train.py",
             *cmd[cmd.index(EXAMPLE) + 1:cmd.index("--json")], *extra, *args.train_args]
    print("== %s: %s" % (name, " ".join(shown)), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.timeout, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        raise SystemExit("compare_compression.py: %s failed with status %d"
                         % (name, proc.returncode))
    with open(log) as f:
        run = json.load(f)
    run.update(name=name, command=" ".join(shown))
    return run


def megabytes(n):
    """``n`` bytes in MB with three significant digits, no exponent: 1,069, 535, 21.4."""
    mb = n / 1e6
    return "{:,.0f}".format(mb) if mb >= 100 else "%.3g" % mb


def table(doc):
    """The markdown table of ``doc`` (the runs' JSON)."""
    plain = doc["runs"][0]["epochs"][-1]["bytes_sent"]
    lines = ["| strategy | evaluation accuracy after %d epochs | bytes sent per rank "
             "| of plain's | time (s) | of which blocked on communication (s) |"
             % doc["epochs"], "|---|---|---|---|---|---|"]
    for run in doc["runs"]:
        last = run["epochs"][-1]
        lines.append("| %s | %.2f %% | %s MB | %.2f %% | %.0f | %.1f |"
                     % (run["name"], 100 * last["eval_accuracy"], megabytes(last["bytes_sent"]),
                        100 * last["bytes_sent"] / plain, run["total_seconds"],
                        last["comm_seconds"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="ranks per training")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per training")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs"), help="output directory")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per training")
    parser.add_argument("--from-json", default=None, metavar="RUNS_JSON",
                        help="train nothing: write the table and the plot of these runs")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="further options for mnist_train.py (after --)")
    args = parser.parse_args(argv)
    args.train_args = [a for a in args.train_args if a != "--"]
    os.makedirs(args.out, exist_ok=True)
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
    else:
        with tempfile.TemporaryDirectory() as scratch:
            runs = [train(name, extra, args, scratch) for name, extra in RUNS]
        doc = {"workers": args.workers, "epochs": args.epochs,
               "train_images": runs[0]["train_images"], "eval_images": runs[0]["eval_images"],
               "command": "python scripts/compare_compression.py" + "".join(
                   " " + a for a in (argv if argv is not None else sys.argv[1:])),
               "runs": runs}
    write(doc, args.out)
    return 0


def write(doc, out):
    """The JSON, the markdown table and the plot of ``doc`` into directory ``out``."""
    paths = {k: os.path.join(out, v) for k, v in (
        ("json", "compression_runs.json"), ("md", "compression_runs.md"),
        ("png", "accuracy_vs_bytes.png"))}
    with open(paths["json"], "w") as f:
        json.dump(doc, f, indent=1)
    text = table(doc)
    with open(paths["md"], "w") as f:
        f.write("# MNIST CNN with each communication saving\n\n`%s`: %d ranks (MPI, numpy, "
                "one BLAS thread each), %d epochs, %d training / %d evaluation images, the "
                "example's defaults and seed. Bytes are the gradient (for partial: "
                "parameter) payload one rank handed to its transports, after compression, "
                "the mean over the ranks. Accuracies and bytes are deterministic; times "
                "depend on the machine's load.\n\n%s\n![accuracy against bytes]"
                "(accuracy_vs_bytes.png)\n"
                % (doc["command"], doc["workers"], doc["epochs"], doc["train_images"],
                   doc["eval_images"], text))
    plot_accuracy_vs_bytes.plot(paths["json"], paths["png"])
    print(text)
    print("wrote %s" % ", ".join(sorted(paths.values())))


if __name__ == "__main__":
    sys.exit(main())
