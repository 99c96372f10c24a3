"""bij.steps."""
