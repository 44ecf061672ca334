"""gradscale's training side: `python -m experiments.run` is the entry point."""
