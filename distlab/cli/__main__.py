"""``python -m distlab.cli ...`` (torchrun's ``-m distlab.cli``): the ``distlab`` command."""
import sys

from . import main

sys.exit(main())
