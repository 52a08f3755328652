"""Do the tests fail when the code is wrong? Plant one small bug at a time
in a module (a mutant) and run the tests that cover it.

    python scripts/mutation_check.py commlib/compression/partial.py
    python scripts/mutation_check.py commlib/faults/board.py --max-mutants 40 --seed 1
    python scripts/mutation_check.py --list-modules
    python scripts/mutation_check.py commlib/faults/board.py --list    # the mutants only
    python scripts/mutation_check.py commlib/faults/board.py --only 14 32   # these two
    python scripts/mutation_check.py commlib/faults/board.py --max-mutants 20 --seed 1 \
        -- tests/faults/test_board.py -k "not slow"     # these pytest arguments instead

For each module named (default: every module of :data:`COVERING`), the
script copies the checkout (the files git tracks or would track, and the
compiled host loops) into a scratch folder, checks that the covering tests
pass there on the module as :func:`ast.unparse` writes it, then, for each
mutant, writes the mutated module into the scratch copy and runs the
covering tests (``pytest -x``, one worker) with a time limit. The real
checkout is never written to. Mutations (on the module's syntax tree):

* a comparison operator shifted or negated: ``<`` to ``<=``, ``<=`` to
  ``<``, ``>`` to ``>=``, ``>=`` to ``>``, ``==`` to ``!=`` and back, ``is``
  to ``is not`` and back, ``in`` to ``not in`` and back;
* ``and`` to ``or`` and back;
* the condition of an ``if``, ``while`` or conditional expression negated;
* an integer constant plus one, and minus one (two mutants);
* a statement that is only a call dropped (``pass`` instead);
* a returned value replaced by None.

A mutant is *killed* when the tests fail, *timed out* when they run past
the limit (a hang; the suite's own bounds would fail it), *survived* when
they pass. The score is (killed + timed out) / mutants. At the end it
prints, per module, the counts and each survivor: its line and mutation.
Exit status: 0 when no mutant survived, 1 otherwise, 2 for bad arguments
or when the tests fail on the unmutated module.

To cover a new module, or after a module moved, edit :data:`COVERING`.
"""
import argparse
import ast
import copy
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: module (path from the checkout's root) -> the pytest arguments of the
#: tests that cover it: files, node ids, ``-k`` expressions. Cheap and
#: in-process tests first: with ``-x`` a mutant is usually killed early.
COVERING = {
    "commlib/faults/board.py": [
        "tests/faults/test_board.py", "tests/faults/test_waits.py", "tests/collective/test_frontend.py",
        "tests/faults/test_stalls.py", "tests/faults/test_faults.py",
        "tests/collective/test_errors.py"],
    "commlib/core/waiting.py": [
        "tests/faults/test_waits.py", "tests/progress/test_inflight.py",
        "tests/faults/test_stalls.py", "tests/faults/test_faults.py"],
    "commlib/compression/partial.py": [
        "tests/compression/test_partial_windows.py", "tests/compression/test_compression.py",
        "tests/faults/test_faults.py::test_new_partial_object_per_call_on_one_rank_keeps_"
        "windows_in_step"],
    "commlib/collective/bucketing.py": [
        "tests/collective/test_bucketing.py", "tests/collective/test_frontend.py",
        "tests/collective/test_collectives.py"],
    "commlib/transport/shm.py": [
        "tests/transport/test_shm_reducer.py", "tests/faults/test_stalls.py"],
    "commlib/transport/mpi.py": [
        "tests/transport/test_mpi_transport.py", "tests/collective/test_collectives.py", "tests/faults/test_stalls.py",
        "tests/faults/test_faults.py", "tests/progress/test_async.py"],
    "commlib/transport/threads.py": [
        "tests/collective/test_p2p.py", "tests/collective/test_frontend.py",
        "tests/faults/test_stalls.py", "tests/compression/test_compression.py"],
    "commlib/collective/collectives.py": [
        "tests/collective/test_frontend.py", "tests/collective/test_collectives.py",
        "tests/collective/test_errors.py", "tests/compression/test_compression.py"],
    "commlib/collective/session.py": [
        "tests/collective/test_frontend.py", "tests/collective/test_errors.py",
        "tests/faults/test_faults.py", "tests/progress/test_async.py"],
    "commlib/collective/validation.py": [
        "tests/collective/test_validation.py", "tests/collective/test_frontend.py",
        "tests/collective/test_errors.py::test_argument_errors_name_argument_rank_and_expectation",
        "tests/collective/test_errors.py::test_consistency_check_raises_on_every_rank"],
    "commlib/compression/half.py": [
        "tests/compression/test_half_range.py", "tests/compression/test_user_plugins.py",
        "tests/compression/test_compression_faults.py", "tests/compression/test_compression.py"],
    "commlib/compression/topk.py": [
        "tests/compression/test_user_plugins.py", "tests/compression/test_compression_faults.py", "tests/collective/test_frontend.py",
        "tests/collective/test_reduce_state.py", "tests/compression/test_compression.py"],
    "commlib/compression/threshold.py": [
        "tests/compression/test_user_plugins.py", "tests/compression/test_compression_faults.py",
        "tests/collective/test_frontend.py", "tests/collective/test_reduce_state.py",
        "tests/compression/test_compression.py"],
    "commlib/compression/nonfinite.py": [
        "tests/compression/test_compression_faults.py", "tests/compression/test_half_range.py",
        "tests/compression/test_compression.py"],
    "commlib/collective/p2p.py": [
        "tests/collective/test_p2p.py"],
    "commlib/collective/exchanges.py": [
        "tests/collective/test_p2p.py"],
    "commlib/faults/peer_watch.py": [
        "tests/faults/test_peer_watch.py", "tests/faults/test_faults.py"],
    "commlib/compression/base.py": [
        "tests/compression/test_user_plugins.py", "tests/compression/test_compression.py"],
}

_FLIPS = {ast.Lt: [ast.LtE], ast.LtE: [ast.Lt], ast.Gt: [ast.GtE], ast.GtE: [ast.Gt],
          ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq], ast.Is: [ast.IsNot], ast.IsNot: [ast.Is],
          ast.In: [ast.NotIn], ast.NotIn: [ast.In]}
_SYMBOLS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==",
            ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not", ast.In: "in",
            ast.NotIn: "not in"}


class Mutant:
    """One mutation: where (``line``), what (``text``), and how to apply it
    to a fresh copy of the module's tree (``apply(tree)``, in place)."""

    def __init__(self, index, line, text, apply):
        self.index, self.line, self.text, self.apply = index, line, text, apply


def _nodes(tree):
    """The tree's nodes in a fixed order, each with its position in it
    (the same order for every copy of the tree)."""
    return list(ast.walk(tree))


def mutants_of(source):
    """Every :class:`Mutant` of the module ``source`` (see the module docstring)."""
    tree = ast.parse(source)
    found = []

    def add(line, text, apply):
        found.append(Mutant(len(found), line, text, apply))

    for at, node in enumerate(_nodes(tree)):
        if isinstance(node, ast.Compare):
            for k, op in enumerate(node.ops):
                for new in _FLIPS.get(type(op), ()):
                    def apply(t, at=at, k=k, new=new):
                        _nodes(t)[at].ops[k] = new()
                    add(node.lineno, "%s -> %s" % (_SYMBOLS[type(op)], _SYMBOLS[new]), apply)
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And

            def apply(t, at=at, new=new):
                _nodes(t)[at].op = new()
            add(node.lineno, "%s -> %s" % ("and" if new is ast.Or else "or",
                                           "or" if new is ast.Or else "and"), apply)
        elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
            def apply(t, at=at):
                target = _nodes(t)[at]
                target.test = ast.UnaryOp(ast.Not(), target.test)
            add(node.lineno, "negate the condition of %s" % type(node).__name__.lower(), apply)
        elif isinstance(node, ast.Constant) and type(node.value) is int:     # not bool
            for delta in (1, -1):
                def apply(t, at=at, delta=delta):
                    target = _nodes(t)[at]
                    target.value = target.value + delta
                add(node.lineno, "%d -> %d" % (node.value, node.value + delta), apply)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            def apply(t, at=at):
                target = _nodes(t)[at]
                target.value = ast.Constant(None)      # a bare ``None``: the call is dropped
            add(node.lineno, "drop the call %s" % _short(ast.unparse(node.value)), apply)
        elif (isinstance(node, ast.Return) and node.value is not None
              and not (isinstance(node.value, ast.Constant) and node.value.value is None)):
            def apply(t, at=at):
                _nodes(t)[at].value = ast.Constant(None)
            add(node.lineno, "return None instead of %s" % _short(ast.unparse(node.value)),
                apply)
    found.sort(key=lambda m: (m.line, m.index))
    for index, m in enumerate(found):
        m.index = index
    return tree, found


def _short(text, width=50):
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def mutated_source(tree, mutant):
    """The module's source with ``mutant`` applied (``tree`` stays as it is)."""
    twin = copy.deepcopy(tree)
    mutant.apply(twin)
    return ast.unparse(ast.fix_missing_locations(twin)) + "\n"


# -- the scratch copy ----------------------------------------------------------------------

def scratch_copy(root):
    """A copy of the checkout at ``root`` in a new private temporary folder:
    the files git tracks or would track (not the ignored ones), and the
    compiled host loops. Returns its path."""
    listed = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], check=True, stdout=subprocess.PIPE).stdout
    scratch = tempfile.mkdtemp(prefix="commlib-mutants-")
    names = [n for n in listed.decode().split("\0") if n]
    names += [os.path.join("commlib", n) for n in os.listdir(os.path.join(root, "commlib"))
              if n.startswith("_hostloops") and n.endswith(".so")]
    for name in names:
        source = os.path.join(root, name)
        if not os.path.isfile(source):       # deleted but still listed
            continue
        target = os.path.join(scratch, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(source, target)
    return scratch


def run_tests(scratch, tests, timeout):
    """Run ``pytest -x`` on ``tests`` in ``scratch`` (its commlib first on
    the path, no bytecode written: a mutant never runs a stale .pyc).
    Returns ("passed" | "failed" | "timed out", seconds, output tail)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [scratch, os.environ.get("PYTHONPATH", "")]), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p",
           "no:randomly", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=scratch, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timed out", time.monotonic() - start, out[-2000:]
    finally:
        try:                                  # ranks left behind by a killed job
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    status = "passed" if proc.returncode == 0 else "failed"
    if proc.returncode == 5:                  # no tests collected: the table is wrong
        raise SystemExit("mutation_check: no tests collected by %s\n%s" % (tests, out[-2000:]))
    return status, time.monotonic() - start, out[-2000:]


def check_module(module, tests, args):
    """Mutate ``module`` one mutant at a time; returns (results, how many
    mutants there were to sample from)."""
    with open(os.path.join(ROOT, module)) as f:
        original = f.read()
    tree, mutants = mutants_of(original)
    if args.lines:
        low, high = args.lines
        mutants = [m for m in mutants if low <= m.line <= high]
    if args.only:
        unknown = sorted(set(args.only) - {m.index for m in mutants})
        if unknown:
            raise SystemExit("mutation_check: %s has no mutant #%s%s" % (
                module, ", #".join(map(str, unknown)), " on those lines" if args.lines else ""))
        mutants = [m for m in mutants if m.index in args.only]
    available = len(mutants)
    if args.max_mutants is not None and len(mutants) > args.max_mutants:
        mutants = sorted(random.Random(args.seed).sample(mutants, args.max_mutants),
                         key=lambda m: m.index)
    if args.list:
        for m in mutants:
            print("%s:%d  #%d  %s" % (module, m.line, m.index, m.text))
        return [], available
    scratch = scratch_copy(ROOT)
    try:
        target = os.path.join(scratch, module)
        probe = subprocess.run([sys.executable, "-c", "import commlib; print(commlib.__file__)"],
                               cwd=scratch, stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=scratch))
        if not probe.stdout.startswith(scratch):
            raise SystemExit("mutation_check: the scratch copy's commlib is not the one "
                             "imported there: %s" % probe.stdout)
        with open(target, "w") as f:          # as ast.unparse writes it, unmutated
            f.write(ast.unparse(tree) + "\n")
        status, seconds, out = run_tests(scratch, tests, args.baseline_timeout)
        if status != "passed":
            print(out, file=sys.stderr)
            raise SystemExit("mutation_check: the covering tests of %s %s on the unmutated "
                             "module (%.0f s); fix that first" % (module, status, seconds))
        limit = args.timeout or max(60.0, 3 * seconds + 30)
        print("%s: %d mutants; the covering tests take %.0f s unmutated, %.0f s allowed per "
              "mutant" % (module, len(mutants), seconds, limit), flush=True)
        results = []
        for m in mutants:
            with open(target, "w") as f:
                f.write(mutated_source(tree, m))
            status, seconds, out = run_tests(scratch, tests, limit)
            outcome = {"failed": "killed", "passed": "survived"}.get(status, status)
            results.append((m, outcome, seconds))
            print("  #%-4d line %-4d %-9s %5.0f s  %s" % (m.index, m.line, outcome, seconds,
                                                          m.text), flush=True)
        return results, available
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def table(module, results, available, args):
    """The summary of one module, as lines of text: the counts, the sample
    (how many of how many, with which seed and lines, to rerun it) and each
    survivor."""
    count = {k: sum(1 for _, o, _ in results if o == k)
             for k in ("killed", "survived", "timed out")}
    total = len(results)
    score = (count["killed"] + count["timed out"]) / total if total else 1.0
    sample = "%d of %d" % (total, available)
    if total < available and args.max_mutants is not None:
        sample += ", seed %d" % args.seed
    if args.lines:
        sample += ", lines %d-%d" % tuple(args.lines)
    if args.only:
        sample += ", #%s" % " #".join(map(str, args.only))
    lines = ["| module | mutants (sample) | killed | timed out | survived | score |",
             "|---|---|---|---|---|---|",
             "| %s | %s | %d | %d | %d | %.0f %% |" % (module, sample, count["killed"],
                                                     count["timed out"], count["survived"],
                                                     100 * score)]
    for m, outcome, _ in results:
        if outcome == "survived":
            lines.append("survived: %s:%d  #%d  %s" % (module, m.line, m.index, m.text))
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="paths from the checkout's root (default: "
                                                   "every module of the table)")
    parser.add_argument("--tests", nargs="+", help="pytest files or node ids instead of the "
                                                   "table's (pytest options such as -k: "
                                                   "after --)")
    parser.add_argument("--max-mutants", type=int, help="a random sample of this many")
    parser.add_argument("--seed", type=int, default=0, help="of the sample (default 0)")
    parser.add_argument("--lines", type=int, nargs=2, metavar=("FIRST", "LAST"),
                        help="only mutants on these lines")
    parser.add_argument("--only", type=int, nargs="+", metavar="N",
                        help="only the mutants of these numbers (#N in the output)")
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: 3 times "
                                                      "the unmutated run, plus 30, at least 60)")
    parser.add_argument("--baseline-timeout", type=float, default=1800.0,
                        help="seconds for the unmutated run (default 1800)")
    parser.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    parser.add_argument("--list-modules", action="store_true", help="print the table")
    argv = list(sys.argv[1:] if argv is None else argv)
    after = argv[argv.index("--") + 1:] if "--" in argv else None
    args = parser.parse_args(argv[:argv.index("--")] if after is not None else argv)
    if after is not None:
        if not after:
            parser.error("no pytest arguments after --")
        if args.tests is not None:
            parser.error("pass the tests either with --tests or after --, not both")
        args.tests = after
    if args.list_modules:
        for module, tests in COVERING.items():
            print("%s: %s" % (module, " ".join(tests)))
        return 0
    if args.max_mutants is not None and args.max_mutants < 1:
        parser.error("--max-mutants must be at least 1, got %d" % args.max_mutants)
    if args.timeout is not None and not args.timeout > 0:
        parser.error("--timeout must be positive, got %r" % args.timeout)
    modules = args.modules or list(COVERING)
    for module in modules:
        if not os.path.isfile(os.path.join(ROOT, module)) or not module.endswith(".py"):
            parser.error("no module %r in %s" % (module, ROOT))
        if args.tests is None and module not in COVERING:
            parser.error("%r has no covering tests in the table (COVERING in %s); pass "
                         "--tests" % (module, __file__))
    summary, survived = [], False
    for module in modules:
        results, available = check_module(module, args.tests or COVERING[module], args)
        if not args.list:
            summary += table(module, results, available, args) + [""]
            survived |= any(o == "survived" for _, o, _ in results)
    if summary:
        print("\n" + "\n".join(summary))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
