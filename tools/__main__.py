import sys

from phalanx.tools.cli import main

sys.exit(main())
