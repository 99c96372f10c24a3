"""The spec's worker side: how input is cut into shards (spec.sharding), how rows are batched (spec.batching),
and the worker pods (spec.workers): resources, placement, pools, retries and the model cache.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from bij.contract.schema import INT64, cel, k8s
from bij.contract.spec_base import SpecModel
from bij.contract.spec_io import MAX_URI

# A Kubernetes resource quantity ("4", "500m", "16Gi"); the CRD uses the same pattern.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


class ShardingSpec(SpecModel):
    target_shard_bytes: int = Field(64 * 1024 * 1024, ge=1024, le=1 << 40, json_schema_extra=INT64)
    """input bytes one shard holds at most"""
    shards_per_lane: int = Field(4, ge=1, le=64)
    """a round is cut into at least this many shards per lane, so its tail is short"""
    min_shard_bytes: int = Field(1024 * 1024, ge=1024, le=1 << 40, json_schema_extra=INT64)
    """never cut shards smaller than this to reach shardsPerLane"""
    chunk_rows: int = Field(512, ge=1, le=1_000_000)
    """rows made durable together; a preempted pod loses at most one chunk"""


class BatchingSpec(SpecModel):
    target_batch_tokens: int | None = Field(None, ge=1)
    """padded tokens per batch (batch engines); default chosen per engine and device"""
    max_batch_size: int | None = Field(None, ge=1)
    """rows per batch (batch engines); default chosen per engine and device"""
    sort_by_length: bool = True
    """rows of similar length run together within the in-flight window (less padding)"""
    prefix_order: bool = True
    """prompts sharing a prefix run together within the in-flight window"""
    prefetch_chunks: int = Field(2, ge=1, le=64)
    """chunks read ahead of the engine"""
    in_flight_rows: int | None = Field(None, ge=1, le=1_000_000)
    """rows read and not yet handed to the commit writer (default 8 x what the engine runs at once, at least 2
    chunks)"""
    commit_queue_chunks: int = Field(4, ge=1, le=64)
    """finished chunks waiting for storage before compute waits too (those waiting together are written in one
    commit)"""


class Toleration(SpecModel):
    # The rules the API server applies to a Pod's tolerations (_pod_rules says the same).
    model_config = ConfigDict(json_schema_extra=k8s(
        cel("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || size(self.value) == 0",
            "a toleration with operator Exists must not have a value"),
        cel("(has(self.key) && size(self.key) > 0) || (has(self.operator) && self.operator == 'Exists')",
            "a toleration without a key must use operator Exists"),
        cel("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            "tolerationSeconds needs effect NoExecute")))

    key: str | None = Field(None, json_schema_extra=k8s(maxLength=317))
    """the taint's key; empty with operator Exists tolerates every taint"""
    operator: Literal["Exists", "Equal"] | None = None
    """Equal (key and value match) or Exists (the key matches)"""
    value: str | None = Field(None, json_schema_extra=k8s(maxLength=63))
    """the taint's value, with operator Equal"""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """the taint effect tolerated; empty for all"""
    toleration_seconds: int | None = Field(None, json_schema_extra=INT64)
    """with effect NoExecute, how long a pod stays on a node tainted so"""

    @model_validator(mode="after")
    def _pod_rules(self) -> Toleration:
        # The same rules the API server applies to a Pod; caught here, not when the Job is created.
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists must not have a value")
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds needs effect NoExecute")
        return self


class ModelCacheSpec(SpecModel):
    model_config = ConfigDict(json_schema_extra=k8s(
        cel("!has(self.type) || self.type != 'hostPath' || (has(self.path) && size(self.path) > 0)",
            "modelCache.type hostPath needs modelCache.path"),
        cel("!has(self.type) || self.type != 'pvc' || (has(self.claimName) && size(self.claimName) > 0)",
            "modelCache.type pvc needs modelCache.claimName")))

    type: Literal["emptyDir", "hostPath", "pvc"] = "emptyDir"
    """emptyDir (the pod's own, gone with it), hostPath (a folder of the node) or pvc (a PersistentVolumeClaim)"""
    path: str | None = Field(None, json_schema_extra=k8s(maxLength=MAX_URI))  # hostPath only
    """hostPath only"""
    claim_name: str | None = Field(None, json_schema_extra=k8s(maxLength=253))  # pvc only
    """pvc only"""
    size_limit: str | None = Field(None, pattern=QUANTITY_PATTERN)  # emptyDir only
    """emptyDir only"""
    mount_path: str = "/models"
    """where the cache is mounted in the worker container"""

    @model_validator(mode="after")
    def _source(self) -> ModelCacheSpec:
        if self.type == "hostPath" and not self.path:
            raise ValueError("modelCache.type hostPath needs modelCache.path")
        if self.type == "pvc" and not self.claim_name:
            raise ValueError("modelCache.type pvc needs modelCache.claimName")
        return self


# A pool's name goes into its Jobs' label and messages: a short DNS label.
POOL_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,14}[a-z0-9])?$"
MAX_POOLS = 8
POOLS_UNIQUE = "workers.pools: each pool needs a name of its own"
POOLS_NOT_GROUPS = "workers.pools cannot be combined with workers.nodesPerLane above 1"


class WorkerPool(SpecModel):
    """One place the worker pods may run (spec.workers.pools, in order of preference): its placement, its price
    and how many lanes it takes; unset fields take spec.workers' value."""

    name: str = Field(pattern=POOL_NAME_PATTERN)
    """the pool's name (a DNS label of at most 16 characters), shown per pool in the status"""
    node_selector: dict[str, str] = {}
    """node labels this pool's worker pods must have (added to workers.nodeSelector)"""
    affinity: dict[str, Any] | None = None
    """a Pod affinity for this pool's pods; default workers.affinity"""
    tolerations: list[Toleration] = Field([], json_schema_extra=k8s(maxItems=64))
    """taints this pool's pods tolerate (added to workers.tolerations)"""
    gpus: int | None = Field(None, ge=0, le=64)
    """GPUs per worker pod in this pool; default workers.gpus"""
    spot: bool | None = None
    """whether this pool is spot/preemptible capacity; default workers.spot"""
    price_per_hour: float | None = Field(None, ge=0, strict=True)
    """price of one worker pod per hour in this pool; default workers.pricePerHour"""
    max_lanes: int | None = Field(None, ge=1, le=10_000)
    """at most this many lanes of a round in this pool; the rest go to the next pools; default no limit"""
    start_timeout_seconds: int = Field(300, ge=1, le=86_400)
    """a pool whose pods stay unschedulable this long (or are preempted again and again) gives its lanes to the
    next pool for the rest of the round"""
    queue_name: str | None = None
    """Kueue LocalQueue of this pool's Jobs; default workers.queueName"""
    tensor_parallel_size: int | None = Field(None, ge=1)
    """model.vllm.tensorParallelSize for this pool's pods (its GPUs differ); default the model's"""


class WorkersSpec(SpecModel):
    model_config = ConfigDict(json_schema_extra=k8s(
        cel("!has(self.pools) || size(self.pools) == 0 || !has(self.nodesPerLane) || self.nodesPerLane == 1",
            POOLS_NOT_GROUPS, ".pools")))

    parallelism: int = Field(4, ge=1, le=10_000)
    """lanes (worker pods, or groups of nodesPerLane pods) that run at once; each works many shards"""
    image: str | None = None  # default: the operator's configured worker image
    """worker image; default is the operator's configured worker image"""
    gpus: int | None = Field(None, ge=0, le=64)
    """GPUs per worker pod (nvidia.com/gpu); unset means tensorParallelSize x pipelineParallelSize for engine vllm,
    none for the other engines"""
    price_per_hour: float | None = Field(None, ge=0, strict=True)
    """price of one worker pod per hour, in any currency; the manifest and status then report cost (total,
    perMillionRows, perMillionTokens)"""
    cpu: str | None = Field(None, pattern=QUANTITY_PATTERN)
    """CPU request and limit, a Kubernetes quantity ("4", "500m")"""
    memory: str | None = Field(None, pattern=QUANTITY_PATTERN)
    """memory request and limit, a Kubernetes quantity ("16Gi")"""
    shm_size: str | None = Field("8Gi", pattern=QUANTITY_PATTERN)
    """size of the in-memory /dev/shm; null mounts none"""
    spot: bool = False
    """schedule on spot/preemptible nodes (preemptions are not counted as failures)"""
    spot_provider: Literal["all", "gke", "eks", "karpenter", "aks"] = "all"
    """which spot node labels to select: one provider's (nodeSelector), or all (tolerate every spot taint and prefer
    any spot label)"""
    steps_on_worker_nodes: bool = False
    """run the step Jobs (plan, finish, publish plan, manifest: small pods without a GPU) with the workers'
    placement (nodeSelector, tolerations, affinity, spot and GPU); default: on any node"""
    node_selector: dict[str, str] = {}
    """node labels the worker pods must have"""
    tolerations: list[Toleration] = Field([], json_schema_extra=k8s(maxItems=64))
    """taints the worker pods tolerate (with spot, also the providers' spot taints)"""
    affinity: dict[str, Any] | None = None
    """a Pod affinity, merged with the spot node affinity"""
    priority_class_name: str | None = None
    """the worker pods' PriorityClass"""
    queue_name: str | None = None
    """Kueue LocalQueue; the round Jobs get the kueue.x-k8s.io/queue-name label"""
    service_account_name: str | None = None
    """the pods' service account; default bij-worker (installed by the chart)"""
    backoff_limit_per_index: int = Field(3, ge=0, le=100)
    """retries of one lane (pod index) after real failures (preemptions do not count)"""
    # A lane renews its claim on the shard it works this often / 3; a shard whose claim is older
    # than this (its pod died) is taken over by another lane.
    lease_seconds: int = Field(60, ge=3, le=3600)
    """a shard whose worker stopped renewing its claim this long is taken over by another lane"""
    nodes_per_lane: int = Field(1, ge=1, le=64)
    """pods (nodes) one lane spans; above 1 the leader runs a Ray head and the bij worker, the others Ray workers,
    and vLLM runs pipeline parallel across them (engine vllm or simulated)"""
    # Kubernetes caps maxFailedIndexes (and completions with backoffLimitPerIndex) at 100000.
    max_failed_indexes: int | None = Field(None, ge=0, le=100_000)
    """fail the round once more shards than this have failed; default lets every shard run"""
    termination_grace_period_seconds: int = Field(60, ge=1, le=3600)
    """seconds a worker pod has after SIGTERM to commit its finished chunks before it is killed"""
    ttl_seconds_after_finished: int | None = Field(86400, ge=0)
    """delete finished round Jobs after this long; null keeps them"""
    model_cache: ModelCacheSpec = ModelCacheSpec()
    """where the model's files are kept on the node: emptyDir, hostPath or a PVC"""
    env: dict[str, str] = {}
    """extra environment variables for the worker container"""
    pools: list[WorkerPool] = Field([], json_schema_extra=k8s(
        maxItems=MAX_POOLS, x_kubernetes_list_type="map", x_kubernetes_list_map_keys=["name"]))
    """places the worker pods may run, in order of preference (a spot pool first, say): a round's lanes fill them
    in order (up to maxLanes each), and a pool whose pods cannot start gives its lanes to the next; each row is
    still done once. Empty: one pool, as workers says"""

    @property
    def pool_prices(self) -> dict[str, float | None] | None:
        """Each pool's price per hour (its own, else pricePerHour); None without pools."""
        if not self.pools:
            return None
        return {p.name: p.price_per_hour if p.price_per_hour is not None else self.price_per_hour for p in self.pools}

    @model_validator(mode="after")
    def _pools(self) -> WorkersSpec:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(POOLS_UNIQUE)
        if self.pools and self.nodes_per_lane > 1:
            raise ValueError(POOLS_NOT_GROUPS)
        return self
