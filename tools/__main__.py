import sys

from phalanx.tools.search_path import keep_repository_last

keep_repository_last()

from phalanx.tools.cli import main  # noqa: E402

sys.exit(main())
