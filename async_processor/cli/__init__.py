"""The command line: ``main`` dispatches the subcommands, ``args`` parses the daemon's flags."""
