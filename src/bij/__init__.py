"""bij: offline batch inference on spot GPUs, as a Kubernetes operator and worker image, or on one machine.

One package in layers, each importing only the layers below it (pyproject.toml's import-linter contracts,
checked by `make lint` and tests/contract/test_imports.py):

- `cli`: the `bij` and `bij-worker` commands (run, operator, render, validate, doctor, publish, status)
- `api` | `local`: bij-api, the OpenAI Batch API in front of the operator | `bij run`, one machine
- `control` | `steps`: the operator's state machine, Job rendering and status (no storage) | the storage
  work a step pod does (planning, round statistics, publish passes, manifest)
- `worker`: the data plane of a lane: reader, inputs, batcher, schedulers, committer, lanes, reports
- `engines`: the inference engines behind one interface (echo, simulated, transformers,
  sentence-transformers, vLLM)
- `storage`: file://, s3://, gs://, hf://, https:// objects; durable segments; Parquet; the result
  writers, one per output format (`storage.writers`)
- `contract`: what every layer agrees on: the spec, the plans, records, layout, codes, errors
"""
