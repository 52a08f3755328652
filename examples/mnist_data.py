"""MNIST for the example: IDX files (LeCun's format, gzipped or not) or an npz file.

``load(path)`` returns ``(train, evaluation)``, each ``(images, labels)`` with
images uint8 (n, 28, 28) and labels int64 (n,):

- a directory holding ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` (each also as
  ``.gz``, or named ``train-images.idx3-ubyte`` and so on, as some mirrors
  name them): the 60,000 / 10,000 split of full MNIST;
- an npz with ``x_train, y_train, x_test, y_test`` (Keras' ``mnist.npz``):
  that split;
- an npz with ``images, labels`` (the shipped ``data/mnist_5k.npz``): split
  once, by a fixed permutation, into ``eval_fraction`` for evaluation and the
  rest for training.

A file that is not what it claims raises :class:`DataError` naming it.
"""
import gzip
import os

import numpy as np

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "mnist_5k.npz")
PIXEL_MEAN, PIXEL_STD = 0.1307, 0.3081   # of the full MNIST training set
BACKGROUND = -PIXEL_MEAN / PIXEL_STD     # a grey level of 0 after normalise()
IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
IDX_NAMES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "eval": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


class DataError(ValueError):
    """A data file that is missing, malformed or inconsistent; the message names it."""


def read_idx(path):
    """The array stored in IDX file ``path`` (``.gz`` is decompressed), native byte order."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:      # gzip.BadGzipFile is an OSError
        raise DataError("%s: cannot read: %s" % (path, exc)) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_DTYPES:
        raise DataError("%s: not an IDX file (the first bytes are %r, expected 0, 0, a type "
                        "code and the number of dimensions)" % (path, raw[:4]))
    dtype, ndim = np.dtype(IDX_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError("%s: truncated IDX header (%d bytes, %d dimensions need %d)"
                        % (path, len(raw), ndim, header))
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, 4))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise DataError("%s: %d bytes, but an IDX array of shape %s and dtype %s takes %d"
                        % (path, len(raw), shape, dtype, expected))
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def idx_path(directory, name):
    """The file of ``name`` in ``directory``: plain, gzipped, or named ``...s.idx3-ubyte``."""
    dotted = name.replace("-idx", ".idx")
    for candidate in (name, name + ".gz", dotted, dotted + ".gz"):
        path = os.path.join(directory, candidate)
        if os.path.isfile(path):
            return path
    raise DataError("%s: no %s (nor %s.gz) in this directory" % (directory, name, name))


def checked(images, labels, source):
    """(images uint8 (n, 28, 28), labels int64 (n,)) after checking their shapes and ranges."""
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim == 2 and images.shape[1] == 784:
        images = images.reshape(-1, 28, 28)
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise DataError("%s: images of shape %s, expected (n, 28, 28)" % (source, images.shape))
    if labels.shape != (len(images),):
        raise DataError("%s: labels of shape %s for %d images"
                        % (source, labels.shape, len(images)))
    if images.dtype != np.uint8 or labels.size and not 0 <= labels.min() <= labels.max() <= 9:
        raise DataError("%s: expected uint8 grey levels and labels 0 to 9 (got %s images, "
                        "labels %s)" % (source, images.dtype, labels.dtype))
    return images, labels.astype(np.int64)


def load_idx(directory):
    """(train, evaluation) from the four IDX files in ``directory``."""
    files = [[idx_path(directory, name) for name in IDX_NAMES[part]] for part in ("train", "eval")]
    return tuple(checked(read_idx(images), read_idx(labels), "%s and %s" % (images, labels))
                 for images, labels in files)


def npz_problem(path):
    """Why ``path`` is not an npz file (judged from its first bytes), or None."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"PK"):                      # a zip archive, as np.savez writes
        return None
    if head.startswith(b"\x93NUMPY"):
        return "it is a single .npy array (np.save), not an npz archive (np.savez)"
    text = head and all(32 <= b < 127 or b in b"\t\r\n" for b in head)
    return ("it is not an npz archive (a zip file of .npy arrays, as np.savez writes) but %s "
            "starting with %r" % ("text" if text else "other data", head))


def load_npz(path, eval_fraction, split_seed):
    """(train, evaluation) from an npz file (see the module doc)."""
    try:
        problem = npz_problem(path)
        if problem is not None:
            raise DataError("%s: cannot read as npz: %s" % (path, problem))
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise DataError("%s: cannot read as npz: %s" % (path, exc)) from None
    if {"x_train", "y_train", "x_test", "y_test"} <= set(arrays):
        return (checked(arrays["x_train"], arrays["y_train"], path),
                checked(arrays["x_test"], arrays["y_test"], path))
    if not {"images", "labels"} <= set(arrays):
        raise DataError("%s: holds %s; expected images and labels, or x_train, y_train, "
                        "x_test and y_test" % (path, sorted(arrays)))
    images, labels = checked(arrays["images"], arrays["labels"], path)
    n_eval = int(round(eval_fraction * len(labels)))
    if not 0 < n_eval < len(labels):
        raise DataError("%s: %d images cannot be split into %d evaluation images and the "
                        "rest for training" % (path, len(labels), n_eval))
    order = np.random.default_rng(split_seed).permutation(len(labels))
    train, evaluation = order[:len(labels) - n_eval], order[len(labels) - n_eval:]
    return (images[train], labels[train]), (images[evaluation], labels[evaluation])


def load(path=SHIPPED, eval_fraction=0.2, split_seed=0):
    """(train, evaluation) from ``path``: a directory of IDX files, one of its IDX files
    (its directory is used) or an npz file. ``eval_fraction`` and ``split_seed``
    apply to an npz of ``images, labels`` only."""
    if os.path.isdir(path):
        return load_idx(path)
    if not os.path.isfile(path):
        raise DataError("%s: no such file or directory" % path)
    if "idx" in os.path.basename(path) and not path.endswith(".npz"):
        return load_idx(os.path.dirname(os.path.abspath(path)))
    return load_npz(path, eval_fraction, split_seed)


def normalise(images):
    """float32 (n, 28, 28, 1): grey levels scaled to [0, 1], then standardised."""
    return ((images.astype(np.float32) / 255.0 - PIXEL_MEAN) / PIXEL_STD)[..., None]
