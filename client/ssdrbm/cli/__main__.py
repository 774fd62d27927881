"""``python -m ssdrbm.cli``: the same as the ``ssdrbm`` command."""

from __future__ import annotations

import sys

from ssdrbm.cli.main import main

sys.exit(main())
