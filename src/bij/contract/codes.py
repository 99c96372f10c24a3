"""Exit codes, labels and annotations: the names the operator, the worker and Kubernetes share.

The round Job's podFailurePolicy fails the Job on `EXIT_BAD_CONFIG`; the operator finds its
Jobs by the labels and the worker's plan by the annotations.
"""

from __future__ import annotations

API_GROUP = "batchinference.io"
PLURAL = "batchinferencejobs"  # the CRD's resource name: the REST path, RBAC rules, kopf's watch

# bij-worker's exit codes (see bij.worker.main).
EXIT_OK = 0
EXIT_FAILED = 1  # worth a retry (the Job's backoffLimitPerIndex decides)
EXIT_BAD_CONFIG = 42  # never worth a retry: the Job's podFailurePolicy fails the Job
EXIT_TERMINATED = 143  # SIGTERM: the in-flight chunk was committed or dropped whole
# A lane of several pods (workers.nodesPerLane) lost a member, or its leader: the group is replaced whole and
# the pod's own index is not to blame (the podFailurePolicy ignores it; the member that failed counts).
EXIT_GROUP_LOST = 44

# Labels on the Jobs (and their pods) the operator creates for a bij.
JOB_LABEL = f"{API_GROUP}/job"  # the bij's name
ROUND_LABEL = f"{API_GROUP}/round"  # a round Job: its round number
PUBLISH_LABEL = f"{API_GROUP}/publish-pass"  # a publish Job: its pass (ids, dedupe, write)
GENERATION_LABEL = f"{API_GROUP}/generation"  # a step Job: the bij's metadata.generation it ran for
STEP_LABEL = f"{API_GROUP}/step"  # a step Job (bij.steps.main): plan-r<r>, finish-r<r>, publish-plan, manifest
CANARY_LABEL = f"{API_GROUP}/canary"  # round 0's canary Job (spec.canary): "true"
POOL_LABEL = f"{API_GROUP}/pool"  # a round Job of spec.workers.pools: the pool it runs in
# A bij made by bij-api for an OpenAI batch (its name is batch-<hex> for batch_<hex>): "true".
OPENAI_BATCH_LABEL = f"{API_GROUP}/openai-batch"

# Annotations: where a Job's work is described.
MANIFEST_ANNOTATION = f"{API_GROUP}/manifest"  # a round Job: its round plan (shards.json)
NODES_PER_LANE_ANNOTATION = f"{API_GROUP}/nodes-per-lane"  # a round Job: pods per lane (index i: lane i // n)
PUBLISH_PLAN_ANNOTATION = f"{API_GROUP}/publish-plan"  # a publish Job: its publish plan (plan.json)
LANE_OFFSET_ANNOTATION = f"{API_GROUP}/lane-offset"  # a pool's round Job: index i is lane offset + i

# Where a pod sends its report (`bij.worker.report`): kube:<namespace>/<name> or dir:<folder>.
REPORT_ENV = "BIJ_REPORT_TO"
# A canary Job's lanes work only the round's first this many shards (spec.canary).
CANARY_SHARDS_ENV = "BIJ_CANARY_SHARDS"
# The pod's name (downward API): the key of its lane report.
POD_NAME_ENV = "POD_NAME"
# The Job's uid (downward API, from the pod's batch.kubernetes.io/controller-uid label): a step's result
# names the Job that made it, so a result left by a deleted Job of the same name is never taken.
JOB_UID_ENV = "BIJ_JOB_UID"
# The Job's name (downward API, from the pod's batch.kubernetes.io/job-name label): a lane's Lease is owned
# by its round's Job, so it goes when the Job (or the bij) does.
JOB_NAME_ENV = "BIJ_JOB_NAME"
# Seconds between two lane reports of a pod (`lane_report.report_interval` of the round's lane count).
REPORT_INTERVAL_ENV = "BIJ_REPORT_INTERVAL"
# A pool's round Job (spec.workers.pools): its index i is lane LANE_OFFSET + i of the round, so lane ids are
# unique across the pools' Jobs and every lane claims from the same round.
LANE_OFFSET_ENV = "BIJ_LANE_OFFSET"
# ... and the pool's name: its shard records name it, so cost is summed per pool at its price.
POOL_ENV = "BIJ_POOL"
# A pool's override of model.vllm.tensorParallelSize (its GPUs differ from the other pools').
TENSOR_PARALLEL_ENV = "BIJ_TENSOR_PARALLEL_SIZE"

# A lane of several pods (spec.workers.nodesPerLane): the operator sets these on the round Job's pods and
# opens these ports on the leader; bij.worker.group reads and listens on them.
NODES_PER_LANE_ENV = "BIJ_NODES_PER_LANE"
GROUP_LEADER_ENV = "BIJ_GROUP_LEADER"  # the leader's host name, "{index}" standing for the leader's index
ROUND_ENV = "BIJ_ROUND"  # the round the Job runs: a member's report names it
RAY_PORT = 6379  # the leader's Ray head (GCS)
GROUP_PORT = 6390  # the leader's group channel: members join, and learn that the lane is done

# The OpenAI endpoints a batch (bij-api) or an OpenAI batch line (the worker) may name, and the model.task
# each runs as.
OPENAI_ENDPOINTS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "generate",
    "/v1/embeddings": "embed",
    "/v1/responses": "chat",  # read as the chat request it asks for (bij.worker.responses)
    # vLLM's pooling endpoints, in the shapes its server takes and answers (a classifier, a cross-encoder).
    "/classify": "classify",
    "/v1/score": "score",
    "/v1/rerank": "rerank",
}
