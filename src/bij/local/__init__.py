"""bij.local."""
