"""``phalanx replay``: show, stats and diff of a recorded protocol trace, and its re-run on fresh
ranks; ``cli.py`` holds the subcommands."""
