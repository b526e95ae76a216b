import sys

from ortcapture.cli import main

sys.exit(main())
