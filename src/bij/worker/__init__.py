"""bij data plane: storage, durable shard logs, reader, batcher, engines and the worker."""
