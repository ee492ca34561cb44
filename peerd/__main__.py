"""`python -m peerd` is the `peerd` command."""

import sys

from peerd.cli import main

sys.exit(main())
