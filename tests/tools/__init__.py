"""The ``phalanx`` command line: its subcommands, benchmarks, eval runner and trace replay."""
