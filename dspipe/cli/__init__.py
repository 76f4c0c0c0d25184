"""The `dspipe` command line: one module per family of subcommands; options shared in cli.options."""
