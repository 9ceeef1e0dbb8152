"""The `msinfer` command line: main.py assembles one module per subcommand."""
