"""``python -m commlib.launch``: see :mod:`commlib.launch`."""
import sys

from .cli import main

sys.exit(main())
