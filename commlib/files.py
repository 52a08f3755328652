"""Writing a file so that no one else can take it over, and no crash leaves
half of it: every file commlib writes (checkpoints, traces, the launcher's
records) goes through :func:`write_atomically`.

The content is written to a temporary file created exclusively, with a
random name, beside the target (``tempfile.mkstemp``: ``O_CREAT | O_EXCL``,
mode 0600, so no name planted in a shared directory such as ``/tmp`` -- a
symlink, or a file another user made writable -- is ever opened), flushed
and fsynced, then renamed over the target (``os.replace``: atomic; a
symlink at the target is replaced, never followed). On any failure (an
exception of ``write``, a full disk, a file size limit, an interrupt) the
temporary is removed and the target is left as it was.
"""
import os
import tempfile

#: the temporaries' names: ``.<target's name>.<random>.tmp`` in the target's folder
TEMP_SUFFIX = ".tmp"


def write_atomically(path, write, binary=False):
    """Write the file ``path`` through ``write(f)``, all or nothing.

    Args:
        path: the file to write (str or path-like); its folder must exist.
        write: ``write(f)`` writes the content to the open file object ``f``.
        binary: ``f`` is a binary file (else text, UTF-8).

    Returns:
        The path written (str); the file has mode 0600 (only its owner
        reads and writes it).

    Raises:
        OSError: the temporary cannot be made, written, synced or renamed
            (nothing is left behind).
        Whatever ``write`` raises (nothing is left behind).
    """
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix="." + name + ".", suffix=TEMP_SUFFIX, dir=folder)
    try:
        f = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")
        fd = None                       # the file object owns it now
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    _sync_folder(folder)
    return path


def _sync_folder(folder):
    """fsync the folder, so that the rename itself survives a crash (best effort)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
