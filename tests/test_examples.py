"""The examples: MNIST training (SINGA's CNN through DistributedOptimizer) under
mpiexec, the launcher and one process, on the shipped digits and on IDX files;
the CNN's gradients and their ready order; the data reader; the comparison
script; the forked-worker example (GPU only, a clear exit on CPU)."""
import gzip
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest

from mpirun import ROOT, mpiexec, run_bounded

EXAMPLES = ROOT / "examples"
MNIST = str(EXAMPLES / "mnist_train.py")
CPU = ["--device", "cpu"]  # numpy arrays also on GPU machines, for comparable digests
# a short CNN run: 2 epochs of 1,280 training images (20 steps of 32 per rank at 2 ranks)
SHORT = ["--epochs", "2", "--train-images", "1280", *CPU]
CNN_FLOATS = 431080                       # the CNN's parameters (float32)
# measured (seed 0, SHORT, 2 ranks): 0.858 (0.1 would be chance)
MIN_SHORT_ACCURACY = 0.8


def run(cmd, timeout=180):
    """Run ``cmd`` from the repository root under a bound (see run_bounded)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the same BLAS threads in every run
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return run_bounded(cmd, timeout, env=env, cwd=ROOT)


def metrics(stdout):
    """(per-epoch [loss, train accuracy, eval accuracy, MB sent] rows, parameter digest)."""
    train = re.findall(r"Training loss = ([\d.]+), training accuracy = ([\d.]+)", stdout)
    evaluation = re.findall(r"Evaluation accuracy = ([\d.]+)", stdout)
    sent = re.findall(r"Images per second = \d+ \(all ranks\), time in communication = "
                      r"[\d.]+ s, bytes sent = ([\d.e+-]+) MB \((?:per rank, so far|"
                      r"one worker: nothing to send)\)", stdout)
    assert len(train) == len(evaluation) == len(sent) and evaluation, stdout
    agree = re.search(r"Parameters identical on all \d+ ranks \(sha256 (\w+)\)", stdout)
    assert agree, "ranks disagree or no final check:\n" + stdout
    return np.array([[float(a), float(b), float(c), float(d)]
                     for (a, b), c, d in zip(train, evaluation, sent)]), agree.group(1)


def example_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import cnn_model
    import mnist_data
    import mnist_train
    return cnn_model, mnist_data, mnist_train


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "run.json"
    proc = run([*mpiexec(), "-n", "2", sys.executable, MNIST, *SHORT, "--json", log])
    assert proc.returncode == 0, proc.stderr
    assert "not built" not in proc.stderr, proc.stderr     # the compiled host loops ran
    return proc.stdout, json.loads(log.read_text())


def test_mnist_two_ranks_trains_the_cnn_and_logs_like_the_seed(two_ranks):
    stdout, log = two_ranks
    rows, _ = metrics(stdout)
    assert "MNIST: 2 workers (" in stdout and "model cnn, 1280 train / 1000 evaluation" in stdout
    assert len(rows) == 2 and stdout.count("Starting Epoch") == 2  # printed by rank 0 only
    assert rows[-1, 2] > MIN_SHORT_ACCURACY, stdout
    assert rows[-1, 0] < rows[0, 0]
    # plain averaging sends every float32 gradient once per step, and clipping the
    # 8-byte float64 squared norm: 20 steps per epoch
    steps = 1280 // 2 // 32
    expected = [steps * (e + 1) * (CNN_FLOATS * 4 + 8) for e in range(2)]
    assert [e["bytes_sent"] for e in log["epochs"]] == expected
    np.testing.assert_allclose(rows[:, 3], np.array(expected) / 1e6, rtol=1e-3)
    assert all(e["comm_seconds"] > 0 and e["images_per_second"] > 0 for e in log["epochs"])
    assert [e["eval_accuracy"] for e in log["epochs"]] == pytest.approx(rows[:, 2], abs=1e-6)


def run_on_terminal(cmd, timeout=180):
    """Run ``cmd`` like :func:`run`, its stderr on a pseudo-terminal (as
    when a user starts it), under a bound; returns (exit status, stdout,
    what reached the terminal)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    master, slave = os.openpty()
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=slave,
                            env=env, cwd=ROOT, start_new_session=True)
    os.close(slave)
    seen = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:                 # EIO: every writer has closed it
                break
            if not data:
                break
            seen.append(data)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("%s timed out\n%s" % (cmd, b"".join(seen).decode(errors="replace")))
    finally:
        reader.join(10)
        os.close(master)
    return proc.returncode, out.decode(), b"".join(seen).decode(errors="replace")


def test_mnist_under_the_launcher_is_deterministic_and_shows_progress(two_ranks):
    """Started from a terminal, the launcher's workers write to pipes; rank 0
    still shows its progress bar (the launcher tells it its own stderr is a
    terminal), the only rank to; the compiled loops are used."""
    code, out, terminal = run_on_terminal([sys.executable, "-m", "commlib.launch", "--backend",
                                           "mpi", "-n", "2", MNIST, *SHORT])
    assert code == 0, terminal
    assert metrics(out)[1] == metrics(two_ranks[0])[1], "same seed, other parameters"
    steps = 1280 // 2 // 32
    for epoch in (0, 1):                    # its first and last states at least
        assert "[0] Epoch %d: 1/%d steps" % (epoch, steps) in terminal, terminal
        assert "Epoch %d: %d/%d steps lr" % (epoch, steps, steps) in terminal, terminal
    assert "[1] Epoch" not in terminal and "not built" not in terminal + out, terminal


@pytest.mark.parametrize("compression, share, min_accuracy", [
    ("fp16", (0.5, 0.5), 0.8), ("bf16", (0.5, 0.5), 0.8),       # measured 0.861, 0.860
    ("topk", (0.01, 0.0205), 0.65),     # ceil(1 %) (index, value) pairs of 8 bytes per bucket;
    # 0.704: its residuals hold back most of the first steps' gradients
    ("threshold", (0.01, 0.1), 0.8),    # measured 5.0 % of plain's bytes, 0.854
    ("partial", (0.01, 0.0105), 0.78)])  # --ratio 0.01 of the parameters per step; 0.840
def test_mnist_with_compression_trains_and_sends_less(compression, share, min_accuracy,
                                                      two_ranks):
    """Every saving still trains (SHORT, seed 0), changes the run (another model than the
    uncompressed one) and sends the share of plain's bytes it should."""
    proc = run([*mpiexec(), "-n", "2", sys.executable, MNIST, "--compression", compression,
                *SHORT])
    assert proc.returncode == 0, proc.stderr
    rows, digest = metrics(proc.stdout)
    assert rows[-1, 2] > min_accuracy, proc.stdout
    assert digest != metrics(two_ranks[0])[1]
    plain = two_ranks[1]["epochs"][-1]["bytes_sent"]
    assert share[0] * plain <= rows[-1, 3] * 1e6 <= share[1] * plain * 1.001, proc.stdout


def test_mnist_one_process_mlp_on_idx_files(tmp_path, monkeypatch):
    """Full-MNIST layout (four IDX files, two gzipped): the split they hold is used."""
    _, mnist_data, _ = example_modules(monkeypatch)
    (images, labels), (eval_images, eval_labels) = mnist_data.load()   # shuffled digits
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", images[:3000])
    write_idx(tmp_path / "train-labels-idx1-ubyte", labels[:3000])
    write_idx(tmp_path / "t10k-images-idx3-ubyte", eval_images[:500])
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", eval_labels[:500])
    proc = run([sys.executable, MNIST, "--model", "mlp", "--epochs", "3", "--data", tmp_path,
                *CPU], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "3000 train / 500 evaluation images" in proc.stdout
    rows, _ = metrics(proc.stdout)
    assert rows[-1, 2] > 0.9, proc.stdout  # measured 0.928
    # one process sends nothing, and says so
    assert rows[:, 3].tolist() == [0, 0, 0], proc.stdout
    assert proc.stdout.count("bytes sent = 0 MB (one worker: nothing to send)") == 3


def test_mnist_rejects_bad_options(tmp_path):
    proc = run([sys.executable, MNIST, "--batch-size", "0"], timeout=60)
    assert proc.returncode == 2 and "--batch-size must be >= 1" in proc.stderr
    proc = run([sys.executable, MNIST, "--compression", "topk", "--ratio", "2"], timeout=60)
    assert proc.returncode == 2 and "ratio must be a number in (0, 1]" in proc.stderr
    bad = tmp_path / "digits.npz"
    bad.write_bytes(b"not a zip file")
    proc = run([sys.executable, MNIST, "--data", bad], timeout=60)
    assert proc.returncode == 2 and "%s: cannot read as npz" % bad in proc.stderr


@pytest.mark.parametrize("content, message", [
    (b"label,pixels\n7,0 0 0\n", "it is not an npz archive (a zip file of .npy arrays, as "
                                  "np.savez writes) but text starting with b'label,pixels\\n7,0'"),
    (b"\x00\x01\x02\x03", "but other data starting with b'\\x00\\x01\\x02\\x03'"),
    ("npy", "it is a single .npy array (np.save), not an npz archive (np.savez)")])
def test_a_file_that_is_not_an_npz_is_described_as_what_it_is(tmp_path, monkeypatch, content,
                                                             message):
    _, mnist_data, _ = example_modules(monkeypatch)
    path = tmp_path / "digits.txt"
    if content == "npy":
        np.save(path.with_suffix(".npy"), np.zeros(3))
        path = path.with_suffix(".npy")
    else:
        path.write_bytes(content)
    with pytest.raises(mnist_data.DataError) as info:
        mnist_data.load(str(path))
    assert str(info.value).startswith("%s: cannot read as npz: " % path)
    assert message in str(info.value) and "pickled" not in str(info.value)


# -- the data reader --------------------------------------------------------------------------

def load_shipped(mnist_data):
    with np.load(mnist_data.SHIPPED) as d:
        return d["images"], d["labels"]


def write_idx(path, array, code=0x08):
    """``array`` as an IDX file (gzipped when ``path`` ends in .gz)."""
    dtype = {0x08: ">u1", 0x0B: ">i2", 0x0D: ">f4"}[code]
    raw = bytes([0, 0, code, array.ndim]) + struct.pack(">%dI" % array.ndim, *array.shape) \
        + np.asarray(array).astype(dtype).tobytes()
    (gzip.open if str(path).endswith(".gz") else open)(path, "wb").write(raw)


@pytest.mark.parametrize("name", ["x-idx3-ubyte", "x-idx3-ubyte.gz"])
def test_read_idx_round_trips_the_shipped_digits(name, tmp_path, monkeypatch):
    _, mnist_data, _ = example_modules(monkeypatch)
    images, labels = load_shipped(mnist_data)
    write_idx(tmp_path / name, images[:777])
    got = mnist_data.read_idx(str(tmp_path / name))
    assert got.dtype == np.uint8 and got.shape == (777, 28, 28)
    np.testing.assert_array_equal(got, images[:777])
    write_idx(tmp_path / ("y" + name[1:]), labels[:0])          # empty
    assert mnist_data.read_idx(str(tmp_path / ("y" + name[1:]))).shape == (0,)
    values = np.array([[1.5, -2.25, 3e9]], np.float32)           # other dtypes, big-endian
    write_idx(tmp_path / "f.idx", values, code=0x0D)
    got = mnist_data.read_idx(str(tmp_path / "f.idx"))
    assert got.dtype == np.float32 and got.dtype.isnative
    np.testing.assert_array_equal(got, values)


def test_idx_directory_with_mirror_names_and_keras_npz(tmp_path, monkeypatch):
    _, mnist_data, _ = example_modules(monkeypatch)
    images, labels = load_shipped(mnist_data)
    parts = {"train-images.idx3-ubyte": images[:301], "train-labels.idx1-ubyte": labels[:301],
             "t10k-images.idx3-ubyte.gz": images[301:400],
             "t10k-labels.idx1-ubyte.gz": labels[301:400]}
    for name, array in parts.items():
        write_idx(tmp_path / name, array)
    (tx, ty), (ex, ey) = mnist_data.load(str(tmp_path))
    np.testing.assert_array_equal(tx, images[:301])
    np.testing.assert_array_equal(ey, labels[301:400])
    assert ty.dtype == np.int64 and ex.shape == (99, 28, 28)
    keras = tmp_path / "mnist.npz"
    np.savez(keras, x_train=images[:50], y_train=labels[:50], x_test=images[50:60],
             y_test=labels[50:60])
    (tx, ty), (ex, ey) = mnist_data.load(str(keras))
    assert tx.shape == (50, 28, 28) and ey.tolist() == labels[50:60].tolist()


def test_shipped_npz_split_is_fixed_and_complete(monkeypatch):
    _, mnist_data, _ = example_modules(monkeypatch)
    images, labels = load_shipped(mnist_data)
    (tx, ty), (ex, ey) = mnist_data.load(eval_fraction=0.2)
    assert len(ty) == 4000 and len(ey) == 1000
    # together the two parts are the shipped digits, each once
    both = np.concatenate([tx, ex]).reshape(5000, -1)
    order = np.lexsort(both.T[::-1])
    ref = images.reshape(5000, -1)
    np.testing.assert_array_equal(both[order], ref[np.lexsort(ref.T[::-1])])
    assert np.bincount(np.concatenate([ty, ey])).tolist() == np.bincount(labels).tolist()
    (tx2, _), _ = mnist_data.load(eval_fraction=0.2)
    np.testing.assert_array_equal(tx, tx2)
    (tx3, _), (ex3, _) = mnist_data.load(eval_fraction=0.1)
    assert len(tx3) == 4500 and len(ex3) == 500


@pytest.mark.parametrize("damage, message", [
    (lambda raw: b"\x08\x03" + raw[2:], "not an IDX file"),
    (lambda raw: raw[:6], "truncated IDX header"),
    (lambda raw: raw[:-5], "bytes, but an IDX array of shape (40, 28, 28)"),
    (lambda raw: raw + b"\x00", "bytes, but an IDX array of shape (40, 28, 28)"),
    (lambda raw: b"", "not an IDX file")])
def test_bad_idx_files_name_the_file(damage, message, tmp_path, monkeypatch):
    _, mnist_data, _ = example_modules(monkeypatch)
    images, _ = load_shipped(mnist_data)
    good = tmp_path / "good-idx3-ubyte"
    write_idx(good, images[:40])
    bad = tmp_path / "bad-idx3-ubyte"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(mnist_data.DataError, match=re.escape(message)) as info:
        mnist_data.read_idx(str(bad))
    assert str(info.value).startswith(str(bad) + ": ")
    gz = tmp_path / "bad-idx3-ubyte.gz"
    gz.write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(mnist_data.DataError, match=re.escape(str(gz) + ": cannot read")):
        mnist_data.read_idx(str(gz))


def test_inconsistent_or_missing_data_names_the_files(tmp_path, monkeypatch):
    _, mnist_data, _ = example_modules(monkeypatch)
    images, labels = load_shipped(mnist_data)
    write_idx(tmp_path / "train-images-idx3-ubyte", images[:10])
    write_idx(tmp_path / "train-labels-idx1-ubyte", labels[:9])
    with pytest.raises(mnist_data.DataError, match="no t10k-images-idx3-ubyte"):
        mnist_data.load(str(tmp_path))
    write_idx(tmp_path / "t10k-images-idx3-ubyte", images[:5])
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels[:5])
    with pytest.raises(mnist_data.DataError, match=r"labels of shape \(9,\) for 10 images"):
        mnist_data.load(str(tmp_path / "train-images-idx3-ubyte"))   # a file: its directory
    write_idx(tmp_path / "train-labels-idx1-ubyte", labels[:10] + 10)
    with pytest.raises(mnist_data.DataError, match="labels 0 to 9"):
        mnist_data.load(str(tmp_path))
    odd = tmp_path / "odd.npz"
    np.savez(odd, pictures=images[:3])
    with pytest.raises(mnist_data.DataError, match=re.escape("%s: holds ['pictures']" % odd)):
        mnist_data.load(str(odd))
    with pytest.raises(mnist_data.DataError, match="no such file or directory"):
        mnist_data.load(str(tmp_path / "absent.npz"))


# -- the model and the training loop's pieces ---------------------------------------------------

def test_cnn_gradients_match_finite_differences(monkeypatch):
    cnn_model, _, _ = example_modules(monkeypatch)
    net = cnn_model.CNN(dtype="float64")
    net.init_params(seed=0)
    rng = np.random.default_rng(0)
    for p in net.params[1::2]:                    # nonzero biases, for an accurate check
        p[...] = rng.normal(0, 0.1, p.shape)
    x, y = rng.normal(size=(3, 28, 28, 1)), np.array([1, 4, 7])
    _, _, dlogits = cnn_model.softmax_cross_entropy(net.forward(x), y)
    net.backward(dlogits)
    eps = 1e-6
    for p, g in zip(net.params, net.grads):
        flat, gflat = p.reshape(-1), g.reshape(-1)
        for j in rng.choice(flat.size, 3, replace=False):
            old = flat[j]
            flat[j] = old + eps
            up = cnn_model.softmax_cross_entropy(net.forward(x), y)[0]
            flat[j] = old - eps
            down = cnn_model.softmax_cross_entropy(net.forward(x), y)[0]
            flat[j] = old
            assert (up - down) / (2 * eps) == pytest.approx(gflat[j], rel=1e-4, abs=1e-8)


def test_backward_marks_each_gradient_ready_once_final_last_layer_first(monkeypatch):
    cnn_model, _, _ = example_modules(monkeypatch)
    net = cnn_model.CNN()
    net.init_params(seed=1)
    assert sum(p.size for p in net.params) == CNN_FLOATS and len(net.params) == 8
    x = np.random.default_rng(2).normal(size=(5, 28, 28, 1)).astype(np.float32)
    _, _, dlogits = cnn_model.softmax_cross_entropy(net.forward(x), np.arange(5))
    seen = {}
    net.backward(dlogits, ready=lambda i: seen.setdefault(i, net.grads[i].copy()))
    assert list(seen) == [7, 6, 5, 4, 3, 2, 1, 0]
    for i, g in seen.items():                     # nothing written after ready(i)
        np.testing.assert_array_equal(g, net.grads[i])
        assert np.abs(g).max() > 0
    grads = commlib_flat(net)
    net.bind_grads(grads)
    net.backward(dlogits)
    for i, mine in enumerate(grads):              # the same values in the bound arrays
        np.testing.assert_array_equal(mine, seen[i])
    with pytest.raises(ValueError, match="grads: shapes"):
        net.bind_grads(grads[:-1])


def commlib_flat(net):
    import commlib
    return commlib.flat_arrays([p.shape for p in net.params], "float32")


def test_shifted_images_are_translates_with_background_border(monkeypatch):
    _, mnist_data, mnist_train = example_modules(monkeypatch)
    images, _ = load_shipped(mnist_data)
    x = mnist_data.normalise(images[::500])            # one of each digit
    assert mnist_train.shifted(x, None, 0) is x
    out = mnist_train.shifted(x, np.random.default_rng(0), 2)
    assert out.shape == x.shape and out.dtype == x.dtype
    offsets = set()
    for a, b in zip(x[..., 0], out[..., 0]):
        matches = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
                   if np.array_equal(b, translate(a, dy, dx, mnist_data.BACKGROUND))]
        assert matches, "not a translate of its input by at most 2 pixels"
        offsets.add(matches[0])
    assert len(offsets) > 1


def translate(a, dy, dx, fill):
    """``a`` (H, W) moved so that out[i, j] = a[i + dy, j + dx], ``fill`` outside."""
    out = np.full_like(a, fill)
    h, w = a.shape
    out[max(0, -dy):h - max(0, dy), max(0, -dx):w - max(0, dx)] = \
        a[max(0, dy):h + min(0, dy), max(0, dx):w + min(0, dx)]
    return out


def test_scheduler_warms_up_then_decays_to_zero(monkeypatch):
    """The example's scheduler object: per step, linear warm-up over --warmup epochs
    (step t at lr * (t + 1) / warmup steps), then a cosine to 0 at the last step."""
    _, _, mnist_train = example_modules(monkeypatch)
    import commlib
    from inprocess import run_ranks

    def lrs(warmup, epochs, steps):
        def body(comm):
            args = mnist_train.parse_args(["--warmup", str(warmup), "--epochs", str(epochs),
                                           "--lr", "0.1", "--train-images", "64"])
            opt = commlib.DistributedOptimizer(comm, [np.zeros(3, np.float32)],
                                               commlib.optim.SGD(args.lr))
            sched = mnist_train.scheduler(opt, args, steps)
            out = []
            for _ in range(steps):
                out.append(opt.lr)
                sched.step()
            return out
        return run_ranks(1, body)[0]

    got = lrs(1, 10, 100)                       # 10 steps per epoch: 10 of warm-up
    assert got[:10] == pytest.approx([0.01 * (t + 1) for t in range(10)], rel=1e-12)
    assert got[10] == pytest.approx(0.1) and got[55] == pytest.approx(0.05)
    assert got[-1] == pytest.approx(0.1 * 0.5 * (1 + np.cos(np.pi * 89 / 90)), rel=1e-12)
    assert lrs(0, 10, 20)[5] == pytest.approx(0.1 * 0.5 * (1 + np.cos(np.pi * 0.25)))
    assert lrs(1, 1, 4) == pytest.approx([0.1 / 3, 0.2 / 3, 0.1, 0.1])   # all but one warm-up


# -- the comparison script ----------------------------------------------------------------------

def test_compare_compression_writes_table_json_and_plot(tmp_path):
    """Six one-epoch trainings of the perceptron on 640 images: the outputs are written
    and consistent with each run's own log."""
    proc = run([sys.executable, ROOT / "scripts" / "compare_compression.py", "--epochs", "1",
                "--out", tmp_path, "--", "--model", "mlp", "--train-images", "640",
                "--clip-norm", "0"],      # no norm all-reduce: the gradients' bytes only
               timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "compression_runs.json").read_text())
    names = [r["name"] for r in doc["runs"]]
    assert names == ["plain", "fp16", "bf16", "top-K 1 %", "threshold 0.03", "partial 10 %"]
    plain = doc["runs"][0]["epochs"][-1]["bytes_sent"]
    assert plain == 10 * (784 * 256 + 256 + 256 * 10 + 10) * 4     # 10 steps of 32 per rank
    assert doc["runs"][1]["epochs"][-1]["bytes_sent"] == plain // 2
    table = (tmp_path / "compression_runs.md").read_text()
    for run_ in doc["runs"]:
        last = run_["epochs"][-1]
        row = next(line for line in table.splitlines() if line.startswith("| %s |" % run_["name"]))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "%.2f %%" % (100 * last["eval_accuracy"])
        assert float(cells[2].replace(",", "").split()[0]) == pytest.approx(
            last["bytes_sent"] / 1e6, rel=5e-3)
        assert cells[3] == "%.2f %%" % (100 * last["bytes_sent"] / plain)
        assert run_["sha256"] and run_["identical"]
    png = (tmp_path / "accuracy_vs_bytes.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10000


def test_committed_comparison_table_is_what_its_runs_say(tmp_path):
    """docs/compression_runs.md and the README table come from docs/compression_runs.json,
    whose runs each logged ten epochs of 4,000 images at 2 ranks and finished identical."""
    docs = ROOT / "docs"
    proc = run([sys.executable, ROOT / "scripts" / "compare_compression.py", "--from-json",
                docs / "compression_runs.json", "--out", tmp_path], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "compression_runs.md").read_text() == \
        (docs / "compression_runs.md").read_text()
    doc = json.loads((docs / "compression_runs.json").read_text())
    assert (doc["workers"], doc["epochs"], doc["train_images"]) == (2, 10, 4000)
    for run_ in doc["runs"]:
        assert len(run_["epochs"]) == 10 and run_["identical"] and run_["workers"] == 2
    table = (docs / "compression_runs.md").read_text()
    rows = table[table.index("| strategy"):table.index("![")].strip()
    assert rows in (EXAMPLES / "README.md").read_text()
    assert rows in (docs / "compression.md").read_text()     # it says it is this output


# -- the forked-worker example --------------------------------------------------------------

def test_forked_workers_without_gpu_exits_with_a_reason():
    from commlib.core import gpu
    if gpu.nccl_unavailable_reason() is None:
        pytest.skip("NCCL is usable here")
    proc = run([sys.executable, EXAMPLES / "forked_workers.py"], timeout=60)
    assert proc.returncode == 1
    assert "forked_workers.py needs cupy with NCCL and a CUDA GPU" in proc.stderr


@pytest.mark.gpu
def test_forked_workers_on_gpu():
    proc = run([sys.executable, EXAMPLES / "forked_workers.py", "--steps", "50"])
    assert proc.returncode == 0, proc.stderr
    assert "parameters identical on all ranks" in proc.stdout


@pytest.mark.gpu
def test_mnist_on_gpu():
    proc = run([sys.executable, "-m", "commlib.launch", "-n", "1", MNIST, "--device", "gpu",
                "--epochs", "2", "--train-images", "1280"])
    assert proc.returncode == 0, proc.stderr
    rows, _ = metrics(proc.stdout)
    assert "cupy" in proc.stdout and rows[-1, 2] > MIN_SHORT_ACCURACY
