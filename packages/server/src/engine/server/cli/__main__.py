"""``python -m engine.server.cli``: the same as the ``engine`` command."""

import sys

from engine.server.cli._main import main

sys.exit(main())
