"""bij.cli: the `bij` and `bij-worker` commands."""
