"""``phalanx bench KIND``: one module per benchmark; ``cli.py`` holds the table of kinds."""
