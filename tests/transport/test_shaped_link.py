"""benchmarks/shaped_link.py: the rate limit bites, TCP carries the bytes,
the namespace is gone afterwards whatever the command did.

Needs root and iproute2 (network namespaces, tc); elsewhere these tests
skip, naming the reason."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import shaped_link  # noqa: E402
from nodes import remove_namespaces, remove_stale, terminate_raises  # noqa: E402


def _usable():
    try:
        shaped_link.make_namespace("commlib-probe-%d" % os.getpid(), "1gbit")
    except shaped_link.ShapedLinkUnavailable as e:
        return str(e)
    finally:                                  # also when interrupted
        shaped_link.delete_namespace("commlib-probe-%d" % os.getpid())
    return None


REASON = _usable()
# the tests compare the machine's namespaces before and after: under
# pytest-xdist (--dist loadgroup) they run in one worker, not side by side
pytestmark = [pytest.mark.skipif(REASON is not None, reason="no shaped link here: %s" % REASON),
              pytest.mark.xdist_group("netns")]
NAME = "commlib-%d" % os.getpid()


@pytest.fixture(autouse=True)
def no_namespace_left():
    """Around every test: the namespaces of dead processes (a run killed
    with SIGKILL) removed before; SIGTERM raising like Ctrl-C, so that the
    ``finally`` clauses run; and after, even when the test failed or was
    interrupted, this process's namespace (``commlib-<pid>``) removed,
    processes in it killed."""
    if REASON is None:
        remove_stale()
    try:
        with terminate_raises():
            yield
    finally:
        if REASON is None:
            remove_namespaces(NAME)


def _end(proc):
    """Kill ``proc`` (a run of benchmarks/shaped_link.py or of a script
    that uses it) if it still runs, and remove the namespace named after
    it with whatever runs in it: a SIGKILL leaves both behind."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    remove_namespaces("commlib-%d" % proc.pid)


def test_rate_limit_bites_and_tcp_carries_the_bytes():
    nbytes = 8 << 20
    measured, theory, carried = shaped_link.check_link("200mbit", nbytes=nbytes, repeats=2,
                                                       timeout=120)
    assert abs(theory - nbytes * 8 / 200e6) < 1e-9     # 2 ranks: each sends nbytes
    assert measured >= 0.9 * theory, (measured, theory)
    assert measured <= 3 * theory, (measured, theory)  # shaped, not stalled
    assert carried >= 2 * 2 * nbytes                    # two repeats, both directions, on lo
    assert not shaped_link.namespace_exists(NAME)


def test_exit_status_passes_through_and_namespace_is_deleted():
    run = shaped_link.run_shaped(["sh", "-c", "ip link show lo; echo $MPIR_CVAR_NOLOCAL "
                                  "$COMMLIB_SHM; exit 3"], "1gbit", capture=True, timeout=60)
    assert run.returncode == 3
    assert "mtu 9000" in run.stdout and "1 0" in run.stdout
    assert not shaped_link.namespace_exists(NAME)


def test_timeout_kills_the_command_and_deletes_the_namespace():
    start = time.monotonic()
    run = shaped_link.run_shaped(["sh", "-c", "sleep 60 & sleep 60"], "1gbit", timeout=2)
    assert run.returncode < 0 and time.monotonic() - start < 30
    assert not shaped_link.namespace_exists(NAME)


def test_a_namespace_left_by_a_killed_run_is_replaced():
    # a run killed with SIGKILL leaves commlib-<its pid>; when the pid comes
    # round again, the next run replaces the empty namespace
    shaped_link.make_namespace(NAME, "1gbit")
    try:
        run = shaped_link.run_shaped(["true"], "1gbit", timeout=60)
    finally:
        shaped_link.delete_namespace(NAME)
    assert run.returncode == 0
    assert not shaped_link.namespace_exists(NAME)


def test_a_namespace_with_processes_in_it_is_refused():
    shaped_link.make_namespace(NAME, "1gbit")
    squatter = subprocess.Popen(["ip", "netns", "exec", NAME, "sleep", "60"])
    try:
        deadline = time.monotonic() + 30
        while not subprocess.run(["ip", "netns", "pids", NAME], capture_output=True,
                                 text=True, timeout=30).stdout.split():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(shaped_link.ShapedLinkUnavailable,
                           match=r"%s already exists and processes %d run in it"
                           % (NAME, squatter.pid)):
            shaped_link.run_shaped(["true"], "1gbit", timeout=60)
        assert squatter.poll() is None                     # left alone
    finally:
        squatter.kill()
        squatter.wait()
        shaped_link.delete_namespace(NAME)


def test_command_line_refuses_byte_units_and_runs_a_command():
    script = str(ROOT / "benchmarks" / "shaped_link.py")
    bad = subprocess.run([sys.executable, script, "--rate", "1gbps", "--", "true"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "bits per second" in bad.stderr
    good = subprocess.run([sys.executable, script, "--rate", "1gbit", "--", "sh", "-c",
                           "exit 5"], capture_output=True, text=True, timeout=60)
    assert good.returncode == 5 and "lo carried" in good.stderr


@pytest.mark.parametrize("rate, bits", [("10gbit", 10**10), ("1.5gbit", 15 * 10**8),
                                        ("500mbit", 5 * 10**8), (2e6, 2 * 10**6)])
def test_parse_rate(rate, bits):
    assert shaped_link.parse_rate(rate) == bits


@pytest.mark.parametrize("rate", ["1gbps", "fast", "-1gbit", "10bit", True])
def test_parse_rate_rejects(rate):
    with pytest.raises(ValueError):
        shaped_link.parse_rate(rate)


def test_ctrl_c_deletes_the_namespace():
    import signal
    script = str(ROOT / "benchmarks" / "shaped_link.py")
    proc = subprocess.Popen([sys.executable, script, "--rate", "1gbit", "--", "sleep", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    name = "commlib-%d" % proc.pid
    try:
        deadline = time.monotonic() + 30
        while not shaped_link.namespace_exists(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert shaped_link.namespace_exists(name)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
        assert proc.returncode != 0
        assert not shaped_link.namespace_exists(name)
    finally:
        _end(proc)


def ctrl_c(taker):
    """A Ctrl-C taken by ``taker``, delivered (its C-level handler has run)
    when this returns: the kernel hands a process-directed Ctrl-C to any
    thread that does not block it (pytest-xdist's workers have several);
    Python then raises in the main thread wherever it is. ``raise_signal``
    directs it at the thread that calls it and returns once it is handled,
    so no sleep has to guess when another thread got it."""
    import signal
    import threading
    if taker == "this thread":
        signal.raise_signal(signal.SIGINT)
        return
    handled = threading.Event()

    def press():
        signal.raise_signal(signal.SIGINT)
        handled.set()
    other = threading.Thread(target=press, daemon=True)
    other.start()
    assert handled.wait(60), "the other thread never took the Ctrl-C"
    other.join(60)


@pytest.mark.parametrize("taker", ["this thread", "another thread"])
def test_ctrl_c_while_the_command_starts_ends_it(monkeypatch, taker):
    # a Ctrl-C that lands while the command's process is being made (here:
    # sent from inside Popen, right after the child exists) still ends that
    # child and deletes the namespace.
    made = []
    real_popen = subprocess.Popen

    def popen_then_ctrl_c(cmd, *args, **kwargs):
        proc = real_popen(cmd, *args, **kwargs)
        if list(cmd[-2:]) == ["sleep", "60"]:             # the command, not an `ip` call
            made.append(proc)
            ctrl_c(taker)
        return proc
    monkeypatch.setattr(shaped_link.subprocess, "Popen", popen_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        shaped_link.run_shaped(["sleep", "60"], "1gbit", timeout=60)
    assert len(made) == 1 and made[0].poll() is not None     # killed and reaped
    assert not shaped_link.namespace_exists(NAME)


def test_break_even_table_over_shm_and_a_shaped_link(tmp_path):
    """benchmarks/break_even.py end to end on the MNIST CNN: every strategy
    on both links, wire bytes as the strategies promise, dense faster
    unshaped than at 200 Mbit/s."""
    import json
    out = tmp_path / "be.json"
    script = str(ROOT / "benchmarks" / "break_even.py")
    proc = subprocess.Popen([sys.executable, script, "--cases", "mnist_cnn", "--links",
                             "shm,200mbit", "--repeats", "1", "--compute-repeats", "1",
                             "--json", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        proc.stdout, proc.stderr = proc.communicate(timeout=300)
    finally:
        leftover = shaped_link.namespace_exists("commlib-%d" % proc.pid)
        _end(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    got = {(r["link"], r["strategy"]): r for r in rows}
    strategies = ["none", "fp16", "bf16", "topk-1%", "topk-0.1%", "threshold-1%", "partial-10%"]
    assert set(got) == {(link, s) for link in ("shm", "200mbit") for s in strategies}, \
        proc.stdout                                        # says why a link was skipped
    dense = got["shm", "none"]["wire_bytes"]
    assert dense == 4 * 431080                             # the CNN's float32 parameters
    for link in ("shm", "200mbit"):
        assert got[link, "fp16"]["wire_bytes"] == dense // 2
        assert got[link, "topk-1%"]["wire_bytes"] < dense // 20
        assert all(r["compute_ms"] > 0 and len(r["times"]) == 1 for r in rows)
    # 1.7 MB at 200 Mbit/s per rank takes at least 69 ms
    assert got["200mbit", "none"]["ms"] >= 60
    assert "| mnist_cnn | 200mbit | none |" in proc.stdout
    # its namespace is gone (named after its process; other tests' come and go)
    assert not leftover
