"""``python -m cluster.cli ...``: the ``tandem`` command."""

import sys

from cluster.cli.main import main

sys.exit(main())
