"""Tracing (commlib.trace): real MPI jobs of 1-3 ranks write one valid
Chrome trace per rank whose events nest per thread, name every collective
with its seq and whose transport bytes add up to ``stats.bytes_sent``;
the program's own spans land on their thread, with their args, around the
collectives they hold; merge and summary; off by default (spans too); an
unwritable path raises at once."""
import json
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import commlib
from commlib import trace
from inprocess import run_ranks
from mpirun import ROOT, assert_each_rank, python_path, run_mpi

SHAPES = str(ROOT / "tests" / "data" / "resnet50.json")
OK = r"rank (?P<rank>\d+) ok "


def traced_job(n, folder, arrays):
    """Run trace_program on ``n`` ranks tracing into ``folder``; returns
    ({rank: its report}, {rank: its trace document})."""
    code = "import sys, trace_program\ntrace_program.main(sys.argv[1], sys.argv[2])\n"
    proc = run_mpi(n, code, timeout=300, args=[SHAPES, str(arrays)],
                   env={"COMMLIB_TRACE": str(folder / "trace.json")})
    assert_each_rank(proc.stdout, OK, n)
    reports = {}      # ranks' lines may interleave: read each report where it starts
    for match in re.finditer(OK, proc.stdout):
        reports[int(match.group("rank"))] = json.JSONDecoder().raw_decode(
            proc.stdout, match.end())[0]
    docs = {}
    for rank in range(n):
        with open(folder / ("trace.rank%d.json" % rank)) as f:
            docs[rank] = json.load(f)
    return reports, docs


def nesting_errors(events):
    """Complete events of one thread that overlap without nesting."""
    threads, errors = {}, []
    for e in events:
        if e["ph"] == "X":
            threads.setdefault((e["pid"], e["tid"]), []).append(e)
    for spans in threads.values():
        stack = []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"]:
                errors.append((stack[-1]["name"], e["name"]))
            stack.append(e)
    return errors


def enclosing(events, inner, outer):
    """For every event of ``inner`` (complete events), the innermost event of
    category ``outer`` among ``events`` on the same thread that contains it,
    other than itself (or None)."""
    found = []
    for e in inner:
        around = [o for o in events if o.get("cat") == outer and o["tid"] == e["tid"]
                  and o is not e and o["ts"] <= e["ts"]
                  and e["ts"] + e["dur"] <= o["ts"] + o["dur"]]
        found.append(max(around, key=lambda o: o["ts"]) if around else None)
    return found


def check_rank(doc, rank, size, report):
    events = doc["traceEvents"]
    assert doc["displayTimeUnit"] == "ms"
    assert doc["otherData"]["rank"] == rank and doc["otherData"]["size"] == size
    assert {e["pid"] for e in events} == {rank}
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {e["tid"] for e in events if e["ph"] != "M"} <= set(names)
    assert "commlib-progress-rank%d" % rank in names.values()
    assert not nesting_errors(events)
    made = [(e["name"], e["args"]["seq"]) for e in sorted(
        (e for e in events if e.get("cat") == "collective"), key=lambda e: e["ts"])]
    assert made == list(zip(report["collectives"], report["seqs"]))
    assert sum(e["args"]["bytes"] for e in events
               if e.get("cat") == "transport") == report["bytes_sent"]
    calls = [e for e in events if e.get("cat") == "transport" and e["args"]["call"] != "barrier"]
    assert None not in enclosing(events, calls, "bucket"), "a transport call outside buckets"
    buckets = [e for e in events if e.get("cat") == "bucket"]
    assert None not in enclosing(events, buckets, "collective")
    assert {b["args"]["compression"] for b in buckets} >= {None, "fp16"}
    assert any(e["ph"] == "f" for e in events) and any(e["name"] == "Work.wait" for e in events)
    check_spans(events, names, report)


def check_spans(events, names, report):
    """The spans of tests/trace_program.py: on the thread that made them, with
    their args, each synchronous all-reduce inside a ``reduce`` inside a ``step``."""
    user = [e for e in events if e.get("cat") == "user"]
    by_name = {}
    for e in user:
        by_name.setdefault(e["name"], []).append(e)
    assert sorted(by_name) == ["compute", "helper", "reduce", "scale", "step"]
    main, helper = report["main_tid"], report["helper_tid"]
    assert {e["tid"] for e in user if e["name"] != "helper"} == {main}
    assert [e["tid"] for e in by_name["helper"]] == [helper]
    assert names[helper] == "helper-thread" and by_name["helper"][0]["args"] == {"job": "7"}
    steps = sorted(by_name["step"], key=lambda e: e["ts"])
    assert [e["args"]["step"] for e in steps] == list(range(6))
    assert [e["args"]["compression"] for e in steps][:3] == ["None", "None", "fp16"]
    assert [e["args"] for e in by_name["scale"]] == [{"factor": 0.5}] * 6
    assert "args" not in by_name["reduce"][0]
    collectives = sorted((e for e in events if e.get("cat") == "collective"),
                         key=lambda e: e["ts"])
    reduces = enclosing(events, [c for c in collectives if c["tid"] == main][:6], "user")
    assert [r["name"] for r in reduces] == ["reduce"] * 6
    assert [s["name"] for s in enclosing(events, reduces, "user")] == ["step"] * 6
    assert [s["name"] for s in enclosing(events, by_name["scale"], "user")] == ["step"] * 6
    compute, = by_name["compute"]
    assert not [c for c in collectives if c["tid"] == main
                and compute["ts"] <= c["ts"] < compute["ts"] + compute["dur"]]
    waits = [e for e in events if e["name"] == "Work.wait" and e["ts"] >= compute["ts"]]
    assert waits and waits[0]["ts"] >= compute["ts"] + compute["dur"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trace2")
    return folder, traced_job(2, folder, 161)


def test_two_ranks_resnet50_trace_per_rank(two_ranks):
    _, (reports, docs) = two_ranks
    for rank in (0, 1):
        check_rank(docs[rank], rank, 2, reports[rank])
        events = docs[rank]["traceEvents"]
        assert any(e["name"] == "consistency check" for e in events)
        assert any(str(e["args"]["compression"]).lower().startswith("topk")
                   for e in events if e.get("cat") == "bucket"), "no TopK bucket"


def run_cli(*args, expect=0):
    env = dict(os.environ, PYTHONPATH=python_path())
    proc = subprocess.run([sys.executable, "-m", "commlib.trace", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    assert "RuntimeWarning" not in proc.stderr
    return proc


def test_merge_and_summary(two_ranks):
    folder, (reports, _) = two_ranks
    merged = folder / "merged.json"
    run_cli("merge", merged, folder)
    with open(merged) as f:
        events = json.load(f)["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {
        "rank 0", "rank 1"}
    assert not nesting_errors(events)
    out = run_cli("summary", merged).stdout
    rows = {int(line.split()[0]): line.split() for line in out.splitlines()[1:3]}
    header = out.splitlines()[0].split()
    assert header[:2] == ["rank", "collectives"] and header[-2:] == ["user_ms", "bytes"]
    for rank in (0, 1):
        assert int(rows[rank][1]) == len(reports[rank]["collectives"])
        assert int(rows[rank][-1]) == reports[rank]["bytes_sent"]
        assert float(rows[rank][5]) > 0, "no compression time: %s" % out
        user = [e for e in events if e.get("cat") == "user" and e["pid"] == rank
                and e["name"] in ("step", "compute", "helper")]     # the outermost ones
        assert float(rows[rank][-2]) == pytest.approx(sum(e["dur"] for e in user) / 1000,
                                                      abs=0.002)


def test_merge_refuses_a_missing_rank(two_ranks, tmp_path):
    folder, _ = two_ranks
    proc = run_cli("merge", tmp_path / "m.json", folder / "trace.rank0.json", expect=2)
    assert "rank(s) [1]" in proc.stderr
    assert not (tmp_path / "m.json").exists()
    assert "usage" in run_cli("--help").stdout


@pytest.mark.parametrize("n", [1, 3])
def test_one_and_three_ranks(n, tmp_path):
    reports, docs = traced_job(n, tmp_path, 40)
    for rank in range(n):
        check_rank(docs[rank], rank, n, reports[rank])
    if n > 1:
        run_cli("merge", tmp_path / "all.json", str(tmp_path / "trace.rank*.json"))


def test_off_by_default_records_nothing(tmp_path, monkeypatch):
    assert "COMMLIB_TRACE" not in os.environ and not trace.ON
    calls = []
    for name in ("now", "collective", "checked", "began", "bucket", "transport_call", "peer_wait",
                 "work_wait", "in_flight", "queued", "closed", "Span", "_span"):
        monkeypatch.setattr(trace, name, lambda *a, _n=name, **k: calls.append(_n))
    monkeypatch.chdir(tmp_path)

    @trace.spanned("reduce", kind="plain")
    def reduce(comm, grads):
        comm.all_reduce(grads)

    def body(comm):
        grads = [np.ones(s, np.float32) for s in ([64, 3, 7, 7], [1000], [2048, 1000])]
        with trace.span("step", step=0) as idle:
            reduce(comm, grads)
            comm.all_reduce(grads, compression="fp16")
        assert idle is trace.span("another")            # one shared object: nothing made
        comm.all_reduce(grads, async_op=True).wait()
        comm.barrier()
        return comm.stats.bytes_sent
    assert all(run_ranks(2, body))
    assert calls == [] and os.listdir(tmp_path) == []


def test_spans_of_thread_ranks_go_to_their_rank(tmp_path):
    """Ranks as threads of one process: a rank's spans, after its first
    collective, are in its own file, on its thread, around its collectives."""
    def body(comm):
        comm.all_reduce([np.ones(10, np.float32)])
        with trace.span("outer", rank=comm.rank):
            comm.all_reduce([np.ones(100, np.float32)])
            scaled(comm)
        return threading.get_native_id()

    @trace.spanned()
    def scaled(comm):
        return comm.rank * 2
    with commlib.trace(tmp_path / "t.json"):
        tids = run_ranks(2, body)
    for rank in (0, 1):
        with open(tmp_path / ("t.rank%d.json" % rank)) as f:
            events = json.load(f)["traceEvents"]
        user = {e["name"]: e for e in events if e.get("cat") == "user"}
        assert sorted(user) == ["outer", scaled.__qualname__]
        assert user["outer"]["args"] == {"rank": rank} and "args" not in user[scaled.__qualname__]
        assert {e["tid"] for e in user.values()} == {tids[rank]}
        last = max((e for e in events if e.get("cat") == "collective"), key=lambda e: e["ts"])
        assert enclosing(events, [last, user[scaled.__qualname__]], "user") == [user["outer"]] * 2
        assert not nesting_errors(events)


def test_a_span_before_any_communicator_records_nothing(tmp_path):
    code = ("import commlib\nfrom commlib import trace\ncommlib.trace(%r)\n"
            "with trace.span('early') as s:\n    assert not isinstance(s, trace.Span)\n"
            "commlib.trace(None)\n" % str(tmp_path / "t.json"))
    env = dict(os.environ, PYTHONPATH=python_path())
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(tmp_path) == []


def test_unwritable_path_raises_when_tracing_starts(tmp_path):
    (tmp_path / "file").write_text("a file, not a folder")
    under_a_file = tmp_path / "file" / "such" / "trace.json"
    with pytest.raises(commlib.ArgumentError,
                       match=r"commlib\.trace\(\).*file/such.*cannot be made"):
        commlib.trace(under_a_file)
    assert not trace.ON
    env = dict(os.environ, PYTHONPATH=python_path(), COMMLIB_TRACE=str(under_a_file))
    proc = subprocess.run([sys.executable, "-c", "import commlib; commlib.Communicator.single()"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0
    assert "COMMLIB_TRACE=" in proc.stderr and "cannot be made" in proc.stderr


def test_context_manager_writes_thread_ranks_and_the_path_rule(tmp_path):
    assert trace.path_for("t.json", 2) == "t.rank2.json"
    assert trace.path_for("run/{rank}/t.json", 1) == "run/1/t.json"
    assert trace.path_for(str(tmp_path), 0) == str(tmp_path / "trace.rank0.json")

    def body(comm):
        comm.all_reduce([np.ones(100, np.float32)])
        return comm.stats.bytes_sent
    with commlib.trace(tmp_path / "t.json"):
        sent = run_ranks(2, body)
    assert not trace.ON
    for rank in (0, 1):
        with open(tmp_path / ("t.rank%d.json" % rank)) as f:
            events = json.load(f)["traceEvents"]
        assert sum(e["args"]["bytes"] for e in events if e.get("cat") == "transport") == \
            sent[rank]
        assert not nesting_errors(events)


def test_completions_are_bucket_events_inside_their_collective(tmp_path):
    """A strategy that returns its buckets' completions (here the 8-bit user
    strategy in that form): its buckets, issued together, are one ``bucket``
    event; each completion is a ``bucket completion`` event named after its
    bucket, after every bucket of its collective was issued and inside that
    collective; bytes still add up to the transport calls'."""
    from user_compression import Int8Deferred

    def body(comm):
        grads = [np.full(s, comm.rank + 1.0, np.float32) for s in (7, 40, 3, 25)]
        comm.all_reduce(grads, compression=Int8Deferred([]))
        return comm.stats.bytes_sent
    with commlib.trace(tmp_path / "t.json"):
        sent = run_ranks(2, body, bucket_bytes=64)
    for rank in (0, 1):
        with open(tmp_path / ("t.rank%d.json" % rank)) as f:
            events = json.load(f)["traceEvents"]
        buckets = [e for e in events if e.get("cat") == "bucket"
                   and e["args"]["compression"] == "user-int8-deferred"]
        issued = [e for e in buckets if "phase" not in e["args"]]
        done = [e for e in buckets if e["args"].get("phase") == "completion"]
        assert len(issued) == 1 and len(done) >= 3, buckets
        assert [e["name"] for e in done] == ["bucket completion"] * len(done)
        # 64-byte buckets: 7 and 3 floats in bucket 0, 40 and 25 (list
        # positions 1 and 3) reduced in place
        assert [e["args"]["index"] for e in done] == [0, "direct 1", "direct 3"]
        assert issued[0]["args"]["index"] == 0
        assert issued[0]["args"]["bytes"] == 4 * (7 + 40 + 3 + 25)
        assert min(e["ts"] for e in done) >= max(e["ts"] + e["dur"] for e in issued)
        assert None not in enclosing(events, done, "collective")
        assert sum(e["args"]["bytes"] for e in events if e.get("cat") == "transport") == \
            sent[rank]
        assert not nesting_errors(events)
