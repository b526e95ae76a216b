"""``python -m ortcapture``: the ``ortcapture`` command (:func:`ortcapture.cli.main`)."""
import sys

from ortcapture.cli import main

sys.exit(main())
