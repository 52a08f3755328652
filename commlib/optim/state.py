"""Checkpoints of a :class:`~commlib.optim.DistributedOptimizer`: its
training state (update count, parameters, the rule's buffers, the groups'
hyperparameters, schedulers and loss scaler; its
:meth:`~commlib.optim.DistributedOptimizer.live_state`) as a dict of numpy
arrays, restored on every rank from one rank's copy, and saved to / loaded
from ``.npz`` files."""
import os
from collections.abc import Mapping

import numpy as np

from ..errors import ArgumentError
from ..files import write_atomically
from ..ops.arrays import is_cupy


def host_copies(arrays):
    """``{name: numpy copy}`` of ``{name: numpy or cupy array}``."""
    return {k: (v.get() if is_cupy(v) else np.array(v, copy=True)) for k, v in arrays.items()}


def optional(name, given):
    """Whether a state ``given`` may lack ``name`` (from before it was kept):
    ``skipped_steps``, ``groups.sizes``, schedulers' ``last_lr``, and the
    groups' hyperparameters when ``given`` has none at all (a state with some
    of them and not others is of another layout)."""
    if name in ("skipped_steps", "groups.sizes") or (
            name.startswith("scheduler.") and name.endswith(".last_lr")):
        return True
    return name.startswith("groups.") and not any(k.startswith("groups.") for k in given)


def _fit(template, given):
    """Copy the arrays of mapping ``given`` into the numpy arrays of
    ``template`` (same parameter groups, names, shapes and dtypes; raw bytes
    of the same width, as ``.npz`` files store bfloat16, are taken as the
    template's dtype). Returns None, or the text of what does not fit (then
    nothing is copied)."""
    if not isinstance(given, Mapping):
        return "expected a dict of arrays (from state_dict()), got %s" % type(given).__name__
    if "groups.sizes" in given:         # torch.optim's checks: number and sizes of the groups
        theirs = np.asarray(given["groups.sizes"]).reshape(-1).tolist()
        mine = template["groups.sizes"].tolist()
        if theirs != mine:
            return ("its parameter groups differ: %d group%s of sizes %s, this optimizer's %d "
                    "of sizes %s" % (len(theirs), "" if len(theirs) == 1 else "s", theirs,
                                     len(mine), mine))
    missing = sorted(k for k in set(template) - set(given) if not optional(k, given))
    unexpected = sorted(set(given) - set(template))
    if missing or unexpected:
        return "names differ from this optimizer's: missing %s, unexpected %s" % (
            missing, unexpected)
    values = {}
    for name, target in template.items():
        if name not in given:
            continue
        value = np.asarray(given[name])
        if value.dtype.kind == "V" and value.dtype.itemsize == target.dtype.itemsize:
            value = value.view(target.dtype)
        if value.shape != target.shape or value.dtype != target.dtype:
            return "%s has shape %s and dtype %s, this optimizer's has shape %s and dtype %s" % (
                name, value.shape, value.dtype, target.shape, target.dtype)
        values[name] = value
    for name, value in values.items():
        template[name][...] = value
    return None


#: bytes of the status the reading rank broadcasts first: a flag, then why
#: the state cannot be loaded (UTF-8, cut to fit)
STATUS_BYTES = 1024


def _status(problem):
    """The status array of ``problem`` (None, or the text of what failed)."""
    status = np.zeros(STATUS_BYTES, np.uint8)
    if problem is not None:
        data = problem.encode("utf-8", "replace")[:STATUS_BYTES - 1]
        status[0] = 1
        status[1:1 + len(data)] = np.frombuffer(data, np.uint8)
    return status


def _restore(opt, read, root, what, path=None):
    """Every rank: ``read()`` on ``root`` gives the state dict, which is
    checked against the optimizer; root broadcasts the outcome first (any
    error of ``read()``, or what does not fit), so that every rank raises
    ArgumentError alike, naming ``what`` (the call) and ``path`` (the file
    read, if any), before the state itself is broadcast and copied into the
    optimizer's live arrays."""
    comm, live = opt.comm, opt.live_state()
    template = host_copies(live)
    status = np.zeros(STATUS_BYTES, np.uint8)
    if comm.rank == root:
        try:
            given = read()
        except Exception as exc:        # whatever reading raised: every rank is told
            problem = "rank %d cannot read %r: %s: %s" % (root, path, type(exc).__name__, exc)
        else:
            try:
                problem = _fit(template, given)
            except Exception as exc:
                problem = "%s: %s" % (type(exc).__name__, exc)
            if problem is not None:
                problem = "rank %d's state%s does not fit: %s" % (
                    root, "" if path is None else " in %r" % (path,), problem)
        status = _status(problem)
    comm.broadcast(status, root=root)
    if status[0]:
        text = bytes(status[1:]).split(b"\0", 1)[0].decode("utf-8", "replace")
        raise ArgumentError("rank %d: %s: %s" % (comm.rank, what, text), culprits=(root,))
    names = sorted(template)
    comm.broadcast([template[k] for k in names], root=root)
    for name in names:
        target, value = live[name], template[name]
        if is_cupy(target):
            target.set(value)
        else:
            target[...] = value
    if hasattr(opt, "loaded"):
        opt.loaded(live)


def load_state_dict(opt, state_dict, root=0):
    """Collective: restore ``root``'s ``state_dict`` (from
    ``opt.state_dict()``; the other ranks' is ignored) into ``opt`` on every
    rank."""
    _restore(opt, lambda: state_dict, root, "load_state_dict")


def save(path, opt):
    """Write ``opt.state_dict()`` to the ``.npz`` file ``path`` (exactly
    that name, mode 0600), all or nothing: through a temporary file of a
    random name beside it, created exclusively, fsynced and renamed over
    ``path`` (:func:`commlib.files.write_atomically`), so a crash or a full
    disk leaves the previous file whole and nothing else behind, and no
    file or symlink another user planted in a shared folder is written
    through. Not collective: call it on one rank.

    Args:
        path: the file's path (str or path-like).
        opt: a :class:`~commlib.optim.DistributedOptimizer`.

    Raises:
        ArgumentError: in the middle of an update (as
            :meth:`~commlib.optim.DistributedOptimizer.state_dict`).
        OSError: the file cannot be written (nothing is left behind).
    """
    state = opt.state_dict()
    write_atomically(path, lambda f: np.savez(f, **state), binary=True)


def load(path, opt, root=0):
    """Collective: ``root`` reads the ``.npz`` file ``path`` (written by
    :func:`save`) and every rank's ``opt`` takes its state (as
    :meth:`~commlib.optim.DistributedOptimizer.load_state_dict`).

    Args:
        path: the file's path, read on ``root`` only.
        opt: a :class:`~commlib.optim.DistributedOptimizer`.
        root: the rank that reads the file.

    Raises:
        ArgumentError: on every rank (``culprits``: ``root``), naming the file
            and the reason, when ``root`` cannot read it (missing, empty,
            truncated, not an ``.npz``, pickled arrays: the error reading
            raised) or its state does not fit ``opt`` (other parameter groups,
            names, shapes or dtypes); ``opt`` is left as it was.
        ClosedError, CollectiveTimeoutError, PeerError: from the collectives
            (see :class:`~commlib.optim.DistributedOptimizer`).
    """
    def read():
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    _restore(opt, read, root, "load",
             os.fspath(path) if isinstance(path, (str, bytes, os.PathLike)) else path)

