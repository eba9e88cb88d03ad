from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_COLOCATED: _ClassVar[Role]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_ACTIVE: _ClassVar[WorkerState]
    WORKER_STATE_SUSPECT: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_DEAD: _ClassVar[WorkerState]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_COLOCATED: Role
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_ACTIVE: WorkerState
WORKER_STATE_SUSPECT: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_DEAD: WorkerState

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Latency(_message.Message):
    __slots__ = ("p50_s", "p99_s", "samples")
    P50_S_FIELD_NUMBER: _ClassVar[int]
    P99_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    p50_s: float
    p99_s: float
    samples: int
    def __init__(self, p50_s: _Optional[float] = ..., p99_s: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("name", "role", "state", "node_id", "node_ip", "pid", "running", "waiting", "kv_blocks_total", "kv_blocks_used", "kv_use", "kv_projected_use", "ttft", "itl", "migrations_out", "migrations_in", "max_num_seqs", "error", "kv_host", "kv_disk", "ranks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_USE_FIELD_NUMBER: _ClassVar[int]
    KV_PROJECTED_USE_FIELD_NUMBER: _ClassVar[int]
    TTFT_FIELD_NUMBER: _ClassVar[int]
    ITL_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_OUT_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_IN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: Role
    state: WorkerState
    node_id: str
    node_ip: str
    pid: int
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_use: float
    kv_projected_use: float
    ttft: Latency
    itl: Latency
    migrations_out: int
    migrations_in: int
    max_num_seqs: int
    error: str
    kv_host: KVTier
    kv_disk: KVTier
    ranks: _containers.RepeatedCompositeFieldContainer[Rank]
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., state: _Optional[_Union[WorkerState, str]] = ..., node_id: _Optional[str] = ..., node_ip: _Optional[str] = ..., pid: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_use: _Optional[float] = ..., kv_projected_use: _Optional[float] = ..., ttft: _Optional[_Union[Latency, _Mapping]] = ..., itl: _Optional[_Union[Latency, _Mapping]] = ..., migrations_out: _Optional[int] = ..., migrations_in: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., error: _Optional[str] = ..., kv_host: _Optional[_Union[KVTier, _Mapping]] = ..., kv_disk: _Optional[_Union[KVTier, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[Rank, _Mapping]]] = ...) -> None: ...

class Rank(_message.Message):
    __slots__ = ("rank", "pid", "device")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    device: str
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class KVTier(_message.Message):
    __slots__ = ("used_bytes", "capacity_bytes", "hits")
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    used_bytes: int
    capacity_bytes: int
    hits: int
    def __init__(self, used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ...) -> None: ...

class RebalancePolicy(_message.Message):
    __slots__ = ("mode", "high", "low", "interval_s", "max_moves")
    MODE_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_MOVES_FIELD_NUMBER: _ClassVar[int]
    mode: str
    high: float
    low: float
    interval_s: float
    max_moves: int
    def __init__(self, mode: _Optional[str] = ..., high: _Optional[float] = ..., low: _Optional[float] = ..., interval_s: _Optional[float] = ..., max_moves: _Optional[int] = ...) -> None: ...

class HealthPolicy(_message.Message):
    __slots__ = ("interval_s", "timeout_s", "suspect_after", "hang_after_s", "dead_after_s")
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_AFTER_FIELD_NUMBER: _ClassVar[int]
    HANG_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    DEAD_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    timeout_s: float
    suspect_after: int
    hang_after_s: float
    dead_after_s: float
    def __init__(self, interval_s: _Optional[float] = ..., timeout_s: _Optional[float] = ..., suspect_after: _Optional[int] = ..., hang_after_s: _Optional[float] = ..., dead_after_s: _Optional[float] = ...) -> None: ...

class PoolPolicy(_message.Message):
    __slots__ = ("min_replicas", "max_replicas", "high", "low", "up_after_s", "down_after_s", "cooldown_s", "step", "slo_s", "queue_tokens")
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    UP_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    DOWN_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    COOLDOWN_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SLO_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    min_replicas: int
    max_replicas: int
    high: float
    low: float
    up_after_s: float
    down_after_s: float
    cooldown_s: float
    step: int
    slo_s: float
    queue_tokens: float
    def __init__(self, min_replicas: _Optional[int] = ..., max_replicas: _Optional[int] = ..., high: _Optional[float] = ..., low: _Optional[float] = ..., up_after_s: _Optional[float] = ..., down_after_s: _Optional[float] = ..., cooldown_s: _Optional[float] = ..., step: _Optional[int] = ..., slo_s: _Optional[float] = ..., queue_tokens: _Optional[float] = ...) -> None: ...

class AutoscalePolicy(_message.Message):
    __slots__ = ("enabled", "interval_s", "prefill", "decode", "colocated")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    interval_s: float
    prefill: PoolPolicy
    decode: PoolPolicy
    colocated: PoolPolicy
    def __init__(self, enabled: _Optional[bool] = ..., interval_s: _Optional[float] = ..., prefill: _Optional[_Union[PoolPolicy, _Mapping]] = ..., decode: _Optional[_Union[PoolPolicy, _Mapping]] = ..., colocated: _Optional[_Union[PoolPolicy, _Mapping]] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("rebalance", "health", "autoscale")
    REBALANCE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_FIELD_NUMBER: _ClassVar[int]
    rebalance: RebalancePolicy
    health: HealthPolicy
    autoscale: AutoscalePolicy
    def __init__(self, rebalance: _Optional[_Union[RebalancePolicy, _Mapping]] = ..., health: _Optional[_Union[HealthPolicy, _Mapping]] = ..., autoscale: _Optional[_Union[AutoscalePolicy, _Mapping]] = ...) -> None: ...

class PoolLook(_message.Message):
    __slots__ = ("replicas", "pressures", "signal", "pressure")
    class PressuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PRESSURES_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    pressures: _containers.ScalarMap[str, float]
    signal: str
    pressure: float
    def __init__(self, replicas: _Optional[int] = ..., pressures: _Optional[_Mapping[str, float]] = ..., signal: _Optional[str] = ..., pressure: _Optional[float] = ...) -> None: ...

class DecisionCount(_message.Message):
    __slots__ = ("role", "direction", "reason", "count")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    role: Role
    direction: str
    reason: str
    count: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., direction: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class AutoscaleStatus(_message.Message):
    __slots__ = ("enabled", "latest", "pools", "counts")
    class LatestEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: PoolLook
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[PoolLook, _Mapping]] = ...) -> None: ...
    class PoolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    latest: _containers.MessageMap[str, PoolLook]
    pools: _containers.ScalarMap[str, int]
    counts: _containers.RepeatedCompositeFieldContainer[DecisionCount]
    def __init__(self, enabled: _Optional[bool] = ..., latest: _Optional[_Mapping[str, PoolLook]] = ..., pools: _Optional[_Mapping[str, int]] = ..., counts: _Optional[_Iterable[_Union[DecisionCount, _Mapping]]] = ...) -> None: ...

class ScaleInProgress(_message.Message):
    __slots__ = ("role", "replicas", "started")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    role: Role
    replicas: int
    started: float
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., replicas: _Optional[int] = ..., started: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("cluster_id", "membership_version", "workers", "policy", "migrations_in_flight", "migration_outcomes", "scaling", "last_event_seq", "model", "autoscale")
    class MigrationOutcomesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    membership_version: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    policy: Policy
    migrations_in_flight: int
    migration_outcomes: _containers.ScalarMap[str, int]
    scaling: _containers.RepeatedCompositeFieldContainer[ScaleInProgress]
    last_event_seq: int
    model: str
    autoscale: AutoscaleStatus
    def __init__(self, cluster_id: _Optional[str] = ..., membership_version: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., policy: _Optional[_Union[Policy, _Mapping]] = ..., migrations_in_flight: _Optional[int] = ..., migration_outcomes: _Optional[_Mapping[str, int]] = ..., scaling: _Optional[_Iterable[_Union[ScaleInProgress, _Mapping]]] = ..., last_event_seq: _Optional[int] = ..., model: _Optional[str] = ..., autoscale: _Optional[_Union[AutoscaleStatus, _Mapping]] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("request_id", "role", "replicas", "wait", "force", "drain_deadline_s", "engine")
    class EngineEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    role: Role
    replicas: int
    wait: bool
    force: bool
    drain_deadline_s: float
    engine: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., replicas: _Optional[int] = ..., wait: _Optional[bool] = ..., force: _Optional[bool] = ..., drain_deadline_s: _Optional[float] = ..., engine: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("role", "previous_replicas", "replicas", "added", "removed", "failed", "aborted_requests", "migrated_requests", "done", "message", "seconds")
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    previous_replicas: int
    replicas: int
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.ScalarMap[str, str]
    aborted_requests: int
    migrated_requests: int
    done: bool
    message: str
    seconds: float
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., previous_replicas: _Optional[int] = ..., replicas: _Optional[int] = ..., added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., failed: _Optional[_Mapping[str, str]] = ..., aborted_requests: _Optional[int] = ..., migrated_requests: _Optional[int] = ..., done: _Optional[bool] = ..., message: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("request_id", "worker", "deadline_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker: str
    deadline_s: float
    def __init__(self, request_id: _Optional[str] = ..., worker: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("worker", "idle", "requests", "counts", "not_moved", "seconds", "note")
    class RequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    NOT_MOVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    worker: str
    idle: bool
    requests: _containers.ScalarMap[str, str]
    counts: _containers.ScalarMap[str, int]
    not_moved: int
    seconds: float
    note: str
    def __init__(self, worker: _Optional[str] = ..., idle: _Optional[bool] = ..., requests: _Optional[_Mapping[str, str]] = ..., counts: _Optional[_Mapping[str, int]] = ..., not_moved: _Optional[int] = ..., seconds: _Optional[float] = ..., note: _Optional[str] = ...) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("request_id", "worker", "role", "deadline_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker: str
    role: Role
    deadline_s: float
    def __init__(self, request_id: _Optional[str] = ..., worker: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class SwitchRoleResponse(_message.Message):
    __slots__ = ("worker", "from_role", "role", "migrated", "aborted", "seconds")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    from_role: Role
    role: Role
    migrated: int
    aborted: int
    seconds: float
    def __init__(self, worker: _Optional[str] = ..., from_role: _Optional[_Union[Role, str]] = ..., role: _Optional[_Union[Role, str]] = ..., migrated: _Optional[int] = ..., aborted: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class UndrainRequest(_message.Message):
    __slots__ = ("request_id", "worker")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker: str
    def __init__(self, request_id: _Optional[str] = ..., worker: _Optional[str] = ...) -> None: ...

class UndrainResponse(_message.Message):
    __slots__ = ("worker", "state")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    worker: str
    state: WorkerState
    def __init__(self, worker: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_id", "request", "from_worker", "to", "count")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FROM_WORKER_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request: str
    from_worker: str
    to: str
    count: int
    def __init__(self, request_id: _Optional[str] = ..., request: _Optional[str] = ..., from_worker: _Optional[str] = ..., to: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class Migration(_message.Message):
    __slots__ = ("request", "outcome", "source", "dest", "reason", "stages", "tokens", "bytes", "pause_s", "seconds")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DEST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    request: str
    outcome: str
    source: str
    dest: str
    reason: str
    stages: int
    tokens: int
    bytes: int
    pause_s: float
    seconds: float
    def __init__(self, request: _Optional[str] = ..., outcome: _Optional[str] = ..., source: _Optional[str] = ..., dest: _Optional[str] = ..., reason: _Optional[str] = ..., stages: _Optional[int] = ..., tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., pause_s: _Optional[float] = ..., seconds: _Optional[float] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Migration]
    def __init__(self, results: _Optional[_Iterable[_Union[Migration, _Mapping]]] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("request_id", "dry_run")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    dry_run: bool
    def __init__(self, request_id: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class RebalanceAction(_message.Message):
    __slots__ = ("request", "from_worker", "to_worker", "from_use", "to_use", "blocks", "avoids_preemption", "outcome")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FROM_WORKER_FIELD_NUMBER: _ClassVar[int]
    TO_WORKER_FIELD_NUMBER: _ClassVar[int]
    FROM_USE_FIELD_NUMBER: _ClassVar[int]
    TO_USE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AVOIDS_PREEMPTION_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    request: str
    from_worker: str
    to_worker: str
    from_use: float
    to_use: float
    blocks: int
    avoids_preemption: bool
    outcome: str
    def __init__(self, request: _Optional[str] = ..., from_worker: _Optional[str] = ..., to_worker: _Optional[str] = ..., from_use: _Optional[float] = ..., to_use: _Optional[float] = ..., blocks: _Optional[int] = ..., avoids_preemption: _Optional[bool] = ..., outcome: _Optional[str] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("actions", "policy")
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    actions: _containers.RepeatedCompositeFieldContainer[RebalanceAction]
    policy: RebalancePolicy
    def __init__(self, actions: _Optional[_Iterable[_Union[RebalanceAction, _Mapping]]] = ..., policy: _Optional[_Union[RebalancePolicy, _Mapping]] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("request_id", "rebalance_mode", "rebalance_high", "rebalance_low", "rebalance_interval_s", "rebalance_max_moves", "health_interval_s", "health_timeout_s", "health_suspect_after", "health_hang_after_s", "health_dead_after_s", "autoscale_enabled", "autoscale_interval_s", "autoscale_pools")
    class AutoscalePoolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: PoolPolicyUpdate
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[PoolPolicyUpdate, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REBALANCE_MODE_FIELD_NUMBER: _ClassVar[int]
    REBALANCE_HIGH_FIELD_NUMBER: _ClassVar[int]
    REBALANCE_LOW_FIELD_NUMBER: _ClassVar[int]
    REBALANCE_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    REBALANCE_MAX_MOVES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEALTH_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HEALTH_SUSPECT_AFTER_FIELD_NUMBER: _ClassVar[int]
    HEALTH_HANG_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    HEALTH_DEAD_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_ENABLED_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_POOLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    rebalance_mode: str
    rebalance_high: float
    rebalance_low: float
    rebalance_interval_s: float
    rebalance_max_moves: int
    health_interval_s: float
    health_timeout_s: float
    health_suspect_after: int
    health_hang_after_s: float
    health_dead_after_s: float
    autoscale_enabled: bool
    autoscale_interval_s: float
    autoscale_pools: _containers.MessageMap[str, PoolPolicyUpdate]
    def __init__(self, request_id: _Optional[str] = ..., rebalance_mode: _Optional[str] = ..., rebalance_high: _Optional[float] = ..., rebalance_low: _Optional[float] = ..., rebalance_interval_s: _Optional[float] = ..., rebalance_max_moves: _Optional[int] = ..., health_interval_s: _Optional[float] = ..., health_timeout_s: _Optional[float] = ..., health_suspect_after: _Optional[int] = ..., health_hang_after_s: _Optional[float] = ..., health_dead_after_s: _Optional[float] = ..., autoscale_enabled: _Optional[bool] = ..., autoscale_interval_s: _Optional[float] = ..., autoscale_pools: _Optional[_Mapping[str, PoolPolicyUpdate]] = ...) -> None: ...

class PoolPolicyUpdate(_message.Message):
    __slots__ = ("min_replicas", "max_replicas", "high", "low", "up_after_s", "down_after_s", "cooldown_s", "step", "slo_s", "queue_tokens")
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    UP_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    DOWN_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    COOLDOWN_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SLO_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    min_replicas: int
    max_replicas: int
    high: float
    low: float
    up_after_s: float
    down_after_s: float
    cooldown_s: float
    step: int
    slo_s: float
    queue_tokens: float
    def __init__(self, min_replicas: _Optional[int] = ..., max_replicas: _Optional[int] = ..., high: _Optional[float] = ..., low: _Optional[float] = ..., up_after_s: _Optional[float] = ..., down_after_s: _Optional[float] = ..., cooldown_s: _Optional[float] = ..., step: _Optional[int] = ..., slo_s: _Optional[float] = ..., queue_tokens: _Optional[float] = ...) -> None: ...

class SetPolicyResponse(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: Policy
    def __init__(self, policy: _Optional[_Union[Policy, _Mapping]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("since",)
    SINCE_FIELD_NUMBER: _ClassVar[int]
    since: int
    def __init__(self, since: _Optional[int] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("kind", "worker", "role", "reason", "node_ip")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[WorkerEvent.Kind]
        KIND_STARTING: _ClassVar[WorkerEvent.Kind]
        KIND_UP: _ClassVar[WorkerEvent.Kind]
        KIND_SUSPECT: _ClassVar[WorkerEvent.Kind]
        KIND_ACTIVE: _ClassVar[WorkerEvent.Kind]
        KIND_DRAINING: _ClassVar[WorkerEvent.Kind]
        KIND_DEAD: _ClassVar[WorkerEvent.Kind]
        KIND_REMOVED: _ClassVar[WorkerEvent.Kind]
        KIND_SWITCHED: _ClassVar[WorkerEvent.Kind]
        KIND_SWITCH_FAILED: _ClassVar[WorkerEvent.Kind]
    KIND_UNSPECIFIED: WorkerEvent.Kind
    KIND_STARTING: WorkerEvent.Kind
    KIND_UP: WorkerEvent.Kind
    KIND_SUSPECT: WorkerEvent.Kind
    KIND_ACTIVE: WorkerEvent.Kind
    KIND_DRAINING: WorkerEvent.Kind
    KIND_DEAD: WorkerEvent.Kind
    KIND_REMOVED: WorkerEvent.Kind
    KIND_SWITCHED: WorkerEvent.Kind
    KIND_SWITCH_FAILED: WorkerEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    kind: WorkerEvent.Kind
    worker: str
    role: Role
    reason: str
    node_ip: str
    def __init__(self, kind: _Optional[_Union[WorkerEvent.Kind, str]] = ..., worker: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., reason: _Optional[str] = ..., node_ip: _Optional[str] = ...) -> None: ...

class ScaleEvent(_message.Message):
    __slots__ = ("phase", "role", "from_replicas", "to_replicas", "reason", "added", "removed", "failed", "aborted_requests", "migrated_requests")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[ScaleEvent.Phase]
        PHASE_STARTED: _ClassVar[ScaleEvent.Phase]
        PHASE_DONE: _ClassVar[ScaleEvent.Phase]
        PHASE_REFUSED: _ClassVar[ScaleEvent.Phase]
    PHASE_UNSPECIFIED: ScaleEvent.Phase
    PHASE_STARTED: ScaleEvent.Phase
    PHASE_DONE: ScaleEvent.Phase
    PHASE_REFUSED: ScaleEvent.Phase
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FROM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TO_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    phase: ScaleEvent.Phase
    role: Role
    from_replicas: int
    to_replicas: int
    reason: str
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.ScalarMap[str, str]
    aborted_requests: int
    migrated_requests: int
    def __init__(self, phase: _Optional[_Union[ScaleEvent.Phase, str]] = ..., role: _Optional[_Union[Role, str]] = ..., from_replicas: _Optional[int] = ..., to_replicas: _Optional[int] = ..., reason: _Optional[str] = ..., added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., failed: _Optional[_Mapping[str, str]] = ..., aborted_requests: _Optional[int] = ..., migrated_requests: _Optional[int] = ...) -> None: ...

class MigrationEvent(_message.Message):
    __slots__ = ("request", "source", "dest", "outcome", "cause", "seconds", "pause_s")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DEST_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    request: str
    source: str
    dest: str
    outcome: str
    cause: str
    seconds: float
    pause_s: float
    def __init__(self, request: _Optional[str] = ..., source: _Optional[str] = ..., dest: _Optional[str] = ..., outcome: _Optional[str] = ..., cause: _Optional[str] = ..., seconds: _Optional[float] = ..., pause_s: _Optional[float] = ...) -> None: ...

class AutoscaleEvent(_message.Message):
    __slots__ = ("role", "direction", "from_replicas", "to_replicas", "signal", "reason", "inputs_json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    FROM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TO_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INPUTS_JSON_FIELD_NUMBER: _ClassVar[int]
    role: Role
    direction: str
    from_replicas: int
    to_replicas: int
    signal: str
    reason: str
    inputs_json: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., direction: _Optional[str] = ..., from_replicas: _Optional[int] = ..., to_replicas: _Optional[int] = ..., signal: _Optional[str] = ..., reason: _Optional[str] = ..., inputs_json: _Optional[str] = ...) -> None: ...

class PolicyEvent(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: Policy
    def __init__(self, policy: _Optional[_Union[Policy, _Mapping]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "time", "missed", "worker", "scale", "migration", "policy", "autoscale")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    MISSED_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: float
    missed: int
    worker: WorkerEvent
    scale: ScaleEvent
    migration: MigrationEvent
    policy: PolicyEvent
    autoscale: AutoscaleEvent
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[float] = ..., missed: _Optional[int] = ..., worker: _Optional[_Union[WorkerEvent, _Mapping]] = ..., scale: _Optional[_Union[ScaleEvent, _Mapping]] = ..., migration: _Optional[_Union[MigrationEvent, _Mapping]] = ..., policy: _Optional[_Union[PolicyEvent, _Mapping]] = ..., autoscale: _Optional[_Union[AutoscaleEvent, _Mapping]] = ...) -> None: ...
