"""``python -m distlab ...``: the ``distlab`` command (`distlab.cli`)."""
import sys

from .cli import main

sys.exit(main())
