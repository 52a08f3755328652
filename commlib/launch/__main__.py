"""``python -m commlib.launch``: see :mod:`commlib.launch`.

A rank's supervisor (``--_worker``) and the rank process (``--_rank``) load
only :mod:`commlib.launch.rank`, not the launcher's command line (which
loads numpy and the start-up code): every process mpiexec starts pays for
its imports."""
import sys

if sys.argv[1:2] in (["--_worker"], ["--_rank"]):
    from .rank import main_internal as _main
else:
    from .cli import main as _main

sys.exit(_main())
