"""Reading commlib trace files back (see :mod:`commlib.trace` for the
format): :func:`merge` joins the ranks' files into one, :func:`summarize`
and :func:`summary_text` make a table per rank, :func:`main` is the command
line ``python -m commlib.trace merge|summary``."""
import glob
import json
import os

from .errors import ArgumentError
from .files import write_atomically


def expand(inputs):
    """The trace files named by ``inputs`` (files, directories, globs)."""
    found = []
    for item in inputs:
        if os.path.isdir(item):
            found += sorted(glob.glob(os.path.join(item, "*.json")))
        elif any(c in item for c in "*?["):
            found += sorted(glob.glob(item))
        else:
            found.append(item)
    return found


def merge(out, inputs):
    """Join per-rank files into ``out`` (one process per rank; written all or
    nothing, mode 0600: :func:`commlib.files.write_atomically`); raises
    ArgumentError for a rank found twice or ranks missing. Returns the ranks."""
    files = [f for f in expand(inputs) if os.path.abspath(f) != os.path.abspath(out)]
    events, ranks, sizes = [], {}, set()
    for name in files:
        with open(name) as f:
            doc = json.load(f)
        other = doc.get("otherData", {})
        rank = other.get("rank")
        if rank is None or "ranks" in other:
            continue            # not one rank's file (a merged one, say)
        if rank in ranks:
            raise ArgumentError("merge: rank %d is in both %s and %s" % (rank, ranks[rank], name))
        ranks[rank] = name
        sizes.add(other.get("size"))
        events += doc["traceEvents"]
    size = max([s for s in sizes if s is not None] + [len(ranks)])
    missing = sorted(set(range(size)) - set(ranks))
    if not ranks or missing:
        raise ArgumentError("merge: no file of rank(s) %s among %s" % (missing or [0], files))
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"ranks": {str(r): ranks[r] for r in sorted(ranks)}, "size": size}}
    write_atomically(out, lambda f: json.dump(doc, f))
    return sorted(ranks)


def summarize(events):
    """{rank: {column: value}} of complete events (see :data:`COLUMNS`)."""
    table = {}
    threads = {}
    for e in events:
        if e.get("ph") == "X":
            threads.setdefault((e["pid"], e["tid"]), []).append(e)
    for (rank, _), spans in sorted(threads.items()):
        row = table.setdefault(rank, dict.fromkeys(COLUMNS, 0))
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in spans:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                stack.pop()
            _count(row, e, stack)
            stack.append([e, 0])
    return table


#: the table's columns; ``user_ms`` is the time in the caller's own spans
#: (:func:`commlib.trace.span`), those inside another of them not counted again
COLUMNS = ("collectives", "collective_ms", "peers_ms", "transport_ms", "compression_ms",
           "wait_ms", "user_ms", "bytes")


def _count(row, e, stack):
    cat, ms = e.get("cat"), e["dur"] / 1000.0
    args = e.get("args") or {}
    if cat == "collective":
        row["collectives"] += 1
        row["collective_ms"] += ms
    elif cat == "transport":
        row["transport_ms"] += ms
        row["bytes"] += args.get("bytes", 0)
        for outer in reversed(stack):           # the bucket it belongs to
            if outer[0].get("cat") == "bucket":
                if outer[0].get("args", {}).get("compression"):
                    row["compression_ms"] -= ms
                break
    elif cat == "bucket" and args.get("compression"):
        row["compression_ms"] += ms
    elif e["name"] in ("consistency check", "wait for peers"):
        row["peers_ms"] += ms
    elif e["name"] == "Work.wait":
        row["wait_ms"] += ms
    elif cat == "user" and not any(outer[0].get("cat") == "user" for outer in stack):
        row["user_ms"] += ms


def summary_text(path):
    with open(path) as f:
        table = summarize(json.load(f)["traceEvents"])
    lines = ["%-5s %11s %13s %9s %12s %14s %9s %9s %14s" % (("rank",) + COLUMNS)]
    for rank, row in sorted(table.items()):
        lines.append("%-5s %11d %13.3f %9.3f %12.3f %14.3f %9.3f %9.3f %14d"
                     % ((rank,) + tuple(row[c] for c in COLUMNS)))
    lines.append("ms: time in collectives; peers: consistency checks and polling waits; "
                 "compression: compressed buckets' time outside their transport calls; "
                 "user: the program's own spans (commlib.trace.span)")
    return "\n".join(lines)


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(prog="python -m commlib.trace",
                                     description="Join or summarize commlib trace files.")
    sub = parser.add_subparsers(dest="command", required=True)
    joined = sub.add_parser("merge", help="join per-rank files into one (Perfetto opens it)")
    joined.add_argument("out", help="the merged file to write")
    joined.add_argument("inputs", nargs="+", help="per-rank files, directories or globs")
    summed = sub.add_parser("summary", help="a table per rank of a trace file")
    summed.add_argument("file", help="a per-rank or merged trace file")
    args = parser.parse_args(argv)
    try:
        if args.command == "merge":
            ranks = merge(args.out, args.inputs)
            print("merged ranks %s into %s" % (ranks, args.out))
        else:
            print(summary_text(args.file))
    except (ArgumentError, OSError, ValueError, KeyError) as exc:
        parser.exit(2, "python -m commlib.trace: %s\n" % exc)
    return 0
