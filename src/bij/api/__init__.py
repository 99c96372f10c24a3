"""`bij-api`: the OpenAI Files and Batches API on a cluster, each batch a BatchInferenceJob.

- `models`: which bij template runs each `model` a batch may ask for (a ConfigMap in the chart)
- `auth`: bearer tokens are service-account tokens, checked with TokenReview; SubjectAccessReview
  says whether their identity may create batchinferencejobs in its namespace
- `files`: uploads and downloads streamed to and from storage under the files prefix
- `batches`: a batch as a bij and a bij as an OpenAI Batch object (pure)
- `server`: the aiohttp application and the `bij-api` entry point
"""
