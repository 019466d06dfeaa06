"""The `shardwise` command line: `shardwise.cli.main:main`, one module per subcommand."""
