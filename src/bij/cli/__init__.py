"""bij.cli."""
