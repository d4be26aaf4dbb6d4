"""``python -m distlab.cli ...`` (torchrun's ``-m distlab.cli``): the ``distlab`` command."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
