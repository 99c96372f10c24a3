"""bij.control: the operator: `decide()`, the driver that applies its decisions, Job rendering, status.
It reads no storage and runs no engine: what touches the data is a step (`bij.steps`) run as a pod."""
