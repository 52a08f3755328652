"""Draw a commlib trace (one rank's file or a merged one, see docs/tracing.md)
as a picture: one row per rank and thread, spans coloured by kind, nested
spans drawn thinner inside their parents; the program's own spans
(commlib.trace.span) are named where they are wide enough.

    python scripts/plot_trace.py MERGED.json OUT.png [--start-ms 40 --width-ms 120]
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

#: colour per event kind (the events' ``cat``)
COLOURS = {"collective": "#4c72b0", "check": "#dd8452", "bucket": "#55a868",
           "transport": "#c44e52", "wait": "#8172b3", "queue": "#937860", "user": "#c8c8c8"}
LABELS = {"collective": "collective", "check": "checks (consistency: waiting for peers)",
          "bucket": "bucket (compression outside transport)", "transport": "transport call",
          "wait": "waiting (peers, Work.wait)", "queue": "enqueue",
          "user": "the program's spans (commlib.trace.span)"}


def rows_of(events):
    """{(rank, thread name): [(ts, dur, cat, depth, name)]} of the complete events."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    threads = {}
    for e in events:
        if e.get("ph") == "X":
            threads.setdefault((e["pid"], e["tid"]), []).append(e)
    rows = {}
    for key, spans in threads.items():
        stack, out = [], []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while stack and e["ts"] >= stack[-1]:
                stack.pop()
            out.append((e["ts"], e["dur"], e.get("cat"), len(stack), e["name"]))
            stack.append(e["ts"] + e["dur"])
        rows[(key[0], names.get(key, str(key[1])))] = out
    return rows


def plot(events, out, start_ms=None, width_ms=None, title=None):
    rows = rows_of(events)
    origin = min(ts for spans in rows.values() for ts, *_ in spans)
    lo = origin + (start_ms or 0) * 1000
    hi = lo + width_ms * 1000 if width_ms else max(
        ts + dur for spans in rows.values() for ts, dur, *_ in spans)
    keys = sorted(rows, key=lambda k: (k[0], not k[1].startswith("Main"), k[1]))
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(keys) + 1.3), dpi=100)
    seen = set()
    for y, key in enumerate(keys):
        for ts, dur, cat, depth, name in rows[key]:
            if ts + dur < lo or ts > hi:
                continue
            height = 0.8 * 0.72 ** depth
            ax.broken_barh([((ts - lo) / 1000, max(dur, 1) / 1000)], (y - height / 2, height),
                           color=COLOURS.get(cat, "#999999"), linewidth=0,
                           label=None if cat in seen else LABELS.get(cat, cat))
            seen.add(cat)
            shown = (min(ts + dur, hi) - max(ts, lo)) / (hi - lo)
            if cat == "user" and shown > 0.09:             # wide enough for its name
                middle = (max(ts, lo) + min(ts + dur, hi)) / 2
                ax.text((middle - lo) / 1000, y + height / 2 - 0.05, name, ha="center",
                        va="bottom", fontsize=6.5, clip_on=True)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels(["rank %d %s" % k for k in keys], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) / 1000)
    ax.set_xlabel("ms")
    ax.set_title(title or "commlib trace", fontsize=9)
    fig.legend(fontsize=7, ncol=3, loc="lower center")
    fig.tight_layout(rect=(0, 0.12 if len(keys) < 6 else 0.08, 1, 1))
    fig.savefig(out)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a trace file (merged or one rank's)")
    parser.add_argument("out", help="the picture to write (.png)")
    parser.add_argument("--start-ms", type=float, default=None,
                        help="window start, ms after the first event (default 0)")
    parser.add_argument("--width-ms", type=float, default=None,
                        help="window width in ms (default: to the last event)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    plot(events, args.out, args.start_ms, args.width_ms, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
