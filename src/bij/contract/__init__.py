"""The contract between the operator and the worker, in one place both packages import.

- `codes`: exit codes, Job labels and annotations
- `errors`: the base of the errors bij raises on purpose (`BijError`, with `.permanent`)
- `spec`: the BatchInferenceJob model (one set of defaults for both sides)
- `layout`: every path under a job's output URI
- `plan`: the round plan (shards.json) the operator writes and the worker reads
- `publish_plan`: the publish plan (publish/plan.json) the operator writes and the publish passes read
- `records`: the durable records (completion, progress, claim, owner, removed)
- `columns`: the names a published row uses, and the input columns it carries (pass-through)

Nothing here imports another layer of bij (pyproject.toml's import contracts hold it to that),
so every layer can import it without another's dependencies.
"""
