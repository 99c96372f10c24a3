"""bij.local: `bij run`, the operator's driver and Job bodies run as local processes."""
