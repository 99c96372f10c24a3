"""bij.worker: the data plane of a lane: reader, inputs, batcher, schedulers, committer, lanes, reports."""
