import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_KIND_UNSPECIFIED: _ClassVar[ModelKind]
    MODEL_KIND_BERNOULLI: _ClassVar[ModelKind]
    MODEL_KIND_GAUSSIAN: _ClassVar[ModelKind]

class VarianceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VARIANCE_KIND_UNSPECIFIED: _ClassVar[VarianceKind]
    VARIANCE_KIND_IDENTITY: _ClassVar[VarianceKind]
    VARIANCE_KIND_ISOTROPIC: _ClassVar[VarianceKind]
    VARIANCE_KIND_DIAGONAL: _ClassVar[VarianceKind]
    VARIANCE_KIND_FULL: _ClassVar[VarianceKind]

class OptimizerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPTIMIZER_KIND_UNSPECIFIED: _ClassVar[OptimizerKind]
    OPTIMIZER_KIND_SGD: _ClassVar[OptimizerKind]
    OPTIMIZER_KIND_NESTEROV: _ClassVar[OptimizerKind]
    OPTIMIZER_KIND_SSD: _ClassVar[OptimizerKind]
    OPTIMIZER_KIND_SSD_PRECONDITIONED: _ClassVar[OptimizerKind]

class PolarMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLAR_METHOD_UNSPECIFIED: _ClassVar[PolarMethod]
    POLAR_METHOD_SVD: _ClassVar[PolarMethod]
    POLAR_METHOD_LOWRANK: _ClassVar[PolarMethod]
    POLAR_METHOD_RANDOMIZED: _ClassVar[PolarMethod]
    POLAR_METHOD_NEWTON_SCHULZ: _ClassVar[PolarMethod]
    POLAR_METHOD_AUTO: _ClassVar[PolarMethod]

class Preconditioner(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECONDITIONER_UNSPECIFIED: _ClassVar[Preconditioner]
    PRECONDITIONER_RMSPROP: _ClassVar[Preconditioner]
    PRECONDITIONER_ADAM: _ClassVar[Preconditioner]

class StepRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_RULE_UNSPECIFIED: _ClassVar[StepRule]
    STEP_RULE_PAPER: _ClassVar[StepRule]
    STEP_RULE_NORMALIZED: _ClassVar[StepRule]

class ScheduleKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULE_KIND_UNSPECIFIED: _ClassVar[ScheduleKind]
    SCHEDULE_KIND_CONSTANT: _ClassVar[ScheduleKind]
    SCHEDULE_KIND_EXPONENTIAL: _ClassVar[ScheduleKind]
    SCHEDULE_KIND_INVERSE_TIME: _ClassVar[ScheduleKind]
    SCHEDULE_KIND_COSINE: _ClassVar[ScheduleKind]

class Preprocess(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREPROCESS_UNSPECIFIED: _ClassVar[Preprocess]
    PREPROCESS_NONE: _ClassVar[Preprocess]
    PREPROCESS_BINARIZE: _ClassVar[Preprocess]
    PREPROCESS_SCALE: _ClassVar[Preprocess]
    PREPROCESS_STANDARDIZE: _ClassVar[Preprocess]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_STOPPED: _ClassVar[JobState]

class LogLikelihoodMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOG_LIKELIHOOD_METHOD_UNSPECIFIED: _ClassVar[LogLikelihoodMethod]
    LOG_LIKELIHOOD_METHOD_EXACT: _ClassVar[LogLikelihoodMethod]
    LOG_LIKELIHOOD_METHOD_AIS: _ClassVar[LogLikelihoodMethod]

class HiddenMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HIDDEN_MODE_UNSPECIFIED: _ClassVar[HiddenMode]
    HIDDEN_MODE_PROBABILITIES: _ClassVar[HiddenMode]
    HIDDEN_MODE_SAMPLE: _ClassVar[HiddenMode]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class ExportFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPORT_FORMAT_UNSPECIFIED: _ClassVar[ExportFormat]
    EXPORT_FORMAT_SAFETENSORS: _ClassVar[ExportFormat]
    EXPORT_FORMAT_ONNX: _ClassVar[ExportFormat]

class SweepMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWEEP_MODE_UNSPECIFIED: _ClassVar[SweepMode]
    SWEEP_MODE_GRID: _ClassVar[SweepMode]
    SWEEP_MODE_RANDOM: _ClassVar[SweepMode]

class AxisScale(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AXIS_SCALE_UNSPECIFIED: _ClassVar[AxisScale]
    AXIS_SCALE_LINEAR: _ClassVar[AxisScale]
    AXIS_SCALE_LOG: _ClassVar[AxisScale]

class SweepState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWEEP_STATE_UNSPECIFIED: _ClassVar[SweepState]
    SWEEP_STATE_RUNNING: _ClassVar[SweepState]
    SWEEP_STATE_SUCCEEDED: _ClassVar[SweepState]
    SWEEP_STATE_FAILED: _ClassVar[SweepState]
    SWEEP_STATE_CANCELLED: _ClassVar[SweepState]
    SWEEP_STATE_EXPIRED: _ClassVar[SweepState]
MODEL_KIND_UNSPECIFIED: ModelKind
MODEL_KIND_BERNOULLI: ModelKind
MODEL_KIND_GAUSSIAN: ModelKind
VARIANCE_KIND_UNSPECIFIED: VarianceKind
VARIANCE_KIND_IDENTITY: VarianceKind
VARIANCE_KIND_ISOTROPIC: VarianceKind
VARIANCE_KIND_DIAGONAL: VarianceKind
VARIANCE_KIND_FULL: VarianceKind
OPTIMIZER_KIND_UNSPECIFIED: OptimizerKind
OPTIMIZER_KIND_SGD: OptimizerKind
OPTIMIZER_KIND_NESTEROV: OptimizerKind
OPTIMIZER_KIND_SSD: OptimizerKind
OPTIMIZER_KIND_SSD_PRECONDITIONED: OptimizerKind
POLAR_METHOD_UNSPECIFIED: PolarMethod
POLAR_METHOD_SVD: PolarMethod
POLAR_METHOD_LOWRANK: PolarMethod
POLAR_METHOD_RANDOMIZED: PolarMethod
POLAR_METHOD_NEWTON_SCHULZ: PolarMethod
POLAR_METHOD_AUTO: PolarMethod
PRECONDITIONER_UNSPECIFIED: Preconditioner
PRECONDITIONER_RMSPROP: Preconditioner
PRECONDITIONER_ADAM: Preconditioner
STEP_RULE_UNSPECIFIED: StepRule
STEP_RULE_PAPER: StepRule
STEP_RULE_NORMALIZED: StepRule
SCHEDULE_KIND_UNSPECIFIED: ScheduleKind
SCHEDULE_KIND_CONSTANT: ScheduleKind
SCHEDULE_KIND_EXPONENTIAL: ScheduleKind
SCHEDULE_KIND_INVERSE_TIME: ScheduleKind
SCHEDULE_KIND_COSINE: ScheduleKind
PREPROCESS_UNSPECIFIED: Preprocess
PREPROCESS_NONE: Preprocess
PREPROCESS_BINARIZE: Preprocess
PREPROCESS_SCALE: Preprocess
PREPROCESS_STANDARDIZE: Preprocess
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_STOPPED: JobState
LOG_LIKELIHOOD_METHOD_UNSPECIFIED: LogLikelihoodMethod
LOG_LIKELIHOOD_METHOD_EXACT: LogLikelihoodMethod
LOG_LIKELIHOOD_METHOD_AIS: LogLikelihoodMethod
HIDDEN_MODE_UNSPECIFIED: HiddenMode
HIDDEN_MODE_PROBABILITIES: HiddenMode
HIDDEN_MODE_SAMPLE: HiddenMode
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_UINT8: DType
EXPORT_FORMAT_UNSPECIFIED: ExportFormat
EXPORT_FORMAT_SAFETENSORS: ExportFormat
EXPORT_FORMAT_ONNX: ExportFormat
SWEEP_MODE_UNSPECIFIED: SweepMode
SWEEP_MODE_GRID: SweepMode
SWEEP_MODE_RANDOM: SweepMode
AXIS_SCALE_UNSPECIFIED: AxisScale
AXIS_SCALE_LINEAR: AxisScale
AXIS_SCALE_LOG: AxisScale
SWEEP_STATE_UNSPECIFIED: SweepState
SWEEP_STATE_RUNNING: SweepState
SWEEP_STATE_SUCCEEDED: SweepState
SWEEP_STATE_FAILED: SweepState
SWEEP_STATE_CANCELLED: SweepState
SWEEP_STATE_EXPIRED: SweepState

class ModelSpec(_message.Message):
    __slots__ = ("kind", "variance", "n_hidden", "min_variance")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VARIANCE_FIELD_NUMBER: _ClassVar[int]
    N_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    MIN_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    kind: ModelKind
    variance: VarianceKind
    n_hidden: int
    min_variance: float
    def __init__(self, kind: _Optional[_Union[ModelKind, str]] = ..., variance: _Optional[_Union[VarianceKind, str]] = ..., n_hidden: _Optional[int] = ..., min_variance: _Optional[float] = ...) -> None: ...

class StepSizeSchedule(_message.Message):
    __slots__ = ("kind", "decay_rate", "decay_steps", "floor", "horizon", "warmup_steps")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DECAY_RATE_FIELD_NUMBER: _ClassVar[int]
    DECAY_STEPS_FIELD_NUMBER: _ClassVar[int]
    FLOOR_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    kind: ScheduleKind
    decay_rate: float
    decay_steps: int
    floor: float
    horizon: int
    warmup_steps: int
    def __init__(self, kind: _Optional[_Union[ScheduleKind, str]] = ..., decay_rate: _Optional[float] = ..., decay_steps: _Optional[int] = ..., floor: _Optional[float] = ..., horizon: _Optional[int] = ..., warmup_steps: _Optional[int] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("kind", "lr", "momentum", "method", "preconditioner", "weight_decay", "max_spectral_norm", "rank", "per_parameter", "per_parameter_lr", "step_rule", "schedule")
    class PerParameterEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: OptimizerKind
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[OptimizerKind, str]] = ...) -> None: ...
    class PerParameterLrEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PRECONDITIONER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECTRAL_NORM_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PER_PARAMETER_FIELD_NUMBER: _ClassVar[int]
    PER_PARAMETER_LR_FIELD_NUMBER: _ClassVar[int]
    STEP_RULE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    kind: OptimizerKind
    lr: float
    momentum: float
    method: PolarMethod
    preconditioner: Preconditioner
    weight_decay: float
    max_spectral_norm: float
    rank: int
    per_parameter: _containers.ScalarMap[str, OptimizerKind]
    per_parameter_lr: _containers.ScalarMap[str, float]
    step_rule: StepRule
    schedule: StepSizeSchedule
    def __init__(self, kind: _Optional[_Union[OptimizerKind, str]] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., method: _Optional[_Union[PolarMethod, str]] = ..., preconditioner: _Optional[_Union[Preconditioner, str]] = ..., weight_decay: _Optional[float] = ..., max_spectral_norm: _Optional[float] = ..., rank: _Optional[int] = ..., per_parameter: _Optional[_Mapping[str, OptimizerKind]] = ..., per_parameter_lr: _Optional[_Mapping[str, float]] = ..., step_rule: _Optional[_Union[StepRule, str]] = ..., schedule: _Optional[_Union[StepSizeSchedule, _Mapping]] = ...) -> None: ...

class TrainingSpec(_message.Message):
    __slots__ = ("cd_k", "persistent", "batch_size", "steps", "epochs", "seed", "checkpoint_every", "max_backoffs", "backoff_factor", "parallel_tempering", "centering")
    CD_K_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    MAX_BACKOFFS_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_FACTOR_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TEMPERING_FIELD_NUMBER: _ClassVar[int]
    CENTERING_FIELD_NUMBER: _ClassVar[int]
    cd_k: int
    persistent: bool
    batch_size: int
    steps: int
    epochs: int
    seed: int
    checkpoint_every: int
    max_backoffs: int
    backoff_factor: float
    parallel_tempering: ParallelTempering
    centering: Centering
    def __init__(self, cd_k: _Optional[int] = ..., persistent: bool = ..., batch_size: _Optional[int] = ..., steps: _Optional[int] = ..., epochs: _Optional[int] = ..., seed: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., max_backoffs: _Optional[int] = ..., backoff_factor: _Optional[float] = ..., parallel_tempering: _Optional[_Union[ParallelTempering, _Mapping]] = ..., centering: _Optional[_Union[Centering, _Mapping]] = ...) -> None: ...

class Centering(_message.Message):
    __slots__ = ("sliding_factor",)
    SLIDING_FACTOR_FIELD_NUMBER: _ClassVar[int]
    sliding_factor: float
    def __init__(self, sliding_factor: _Optional[float] = ...) -> None: ...

class ParallelTempering(_message.Message):
    __slots__ = ("temperatures", "min_beta")
    TEMPERATURES_FIELD_NUMBER: _ClassVar[int]
    MIN_BETA_FIELD_NUMBER: _ClassVar[int]
    temperatures: int
    min_beta: float
    def __init__(self, temperatures: _Optional[int] = ..., min_beta: _Optional[float] = ...) -> None: ...

class EvalSpec(_message.Message):
    __slots__ = ("every", "ais", "ais_chains", "ais_betas", "validation_fraction")
    EVERY_FIELD_NUMBER: _ClassVar[int]
    AIS_FIELD_NUMBER: _ClassVar[int]
    AIS_CHAINS_FIELD_NUMBER: _ClassVar[int]
    AIS_BETAS_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_FRACTION_FIELD_NUMBER: _ClassVar[int]
    every: int
    ais: bool
    ais_chains: int
    ais_betas: int
    validation_fraction: float
    def __init__(self, every: _Optional[int] = ..., ais: bool = ..., ais_chains: _Optional[int] = ..., ais_betas: _Optional[int] = ..., validation_fraction: _Optional[float] = ...) -> None: ...

class BuiltinDataset(_message.Message):
    __slots__ = ("name", "options")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    options: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DatasetRef(_message.Message):
    __slots__ = ("builtin", "dataset_id", "preprocess")
    BUILTIN_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_FIELD_NUMBER: _ClassVar[int]
    builtin: BuiltinDataset
    dataset_id: str
    preprocess: Preprocess
    def __init__(self, builtin: _Optional[_Union[BuiltinDataset, _Mapping]] = ..., dataset_id: _Optional[str] = ..., preprocess: _Optional[_Union[Preprocess, str]] = ...) -> None: ...

class StartTrainingRequest(_message.Message):
    __slots__ = ("model", "optimizer", "training", "eval", "dataset", "request_id", "name", "validate_only", "spec_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: ModelSpec
    optimizer: OptimizerSpec
    training: TrainingSpec
    eval: EvalSpec
    dataset: DatasetRef
    request_id: str
    name: str
    validate_only: bool
    spec_version: int
    def __init__(self, model: _Optional[_Union[ModelSpec, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., training: _Optional[_Union[TrainingSpec, _Mapping]] = ..., eval: _Optional[_Union[EvalSpec, _Mapping]] = ..., dataset: _Optional[_Union[DatasetRef, _Mapping]] = ..., request_id: _Optional[str] = ..., name: _Optional[str] = ..., validate_only: bool = ..., spec_version: _Optional[int] = ...) -> None: ...

class StartTrainingResponse(_message.Message):
    __slots__ = ("job", "created")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    job: Job
    created: bool
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., created: bool = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "name", "state", "spec", "step", "total_steps", "attempt", "error", "checkpoint_step", "worker", "created_at", "started_at", "finished_at", "n_visible", "latest_metrics", "runtime", "backoffs", "training_process_failures", "sweep_id", "queue")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    N_VISIBLE_FIELD_NUMBER: _ClassVar[int]
    LATEST_METRICS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    BACKOFFS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_PROCESS_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SWEEP_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    state: JobState
    spec: StartTrainingRequest
    step: int
    total_steps: int
    attempt: int
    error: str
    checkpoint_step: int
    worker: str
    created_at: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    n_visible: int
    latest_metrics: Metrics
    runtime: Runtime
    backoffs: int
    training_process_failures: int
    sweep_id: str
    queue: QueuePlace
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., spec: _Optional[_Union[StartTrainingRequest, _Mapping]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., attempt: _Optional[int] = ..., error: _Optional[str] = ..., checkpoint_step: _Optional[int] = ..., worker: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., n_visible: _Optional[int] = ..., latest_metrics: _Optional[_Union[Metrics, _Mapping]] = ..., runtime: _Optional[_Union[Runtime, _Mapping]] = ..., backoffs: _Optional[int] = ..., training_process_failures: _Optional[int] = ..., sweep_id: _Optional[str] = ..., queue: _Optional[_Union[QueuePlace, _Mapping]] = ...) -> None: ...

class QueuePlace(_message.Message):
    __slots__ = ("position", "starts_in_seconds", "basis", "busy_slots", "slice_seconds", "no_worker")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    STARTS_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NO_WORKER_FIELD_NUMBER: _ClassVar[int]
    position: int
    starts_in_seconds: float
    basis: str
    busy_slots: int
    slice_seconds: float
    no_worker: bool
    def __init__(self, position: _Optional[int] = ..., starts_in_seconds: _Optional[float] = ..., basis: _Optional[str] = ..., busy_slots: _Optional[int] = ..., slice_seconds: _Optional[float] = ..., no_worker: bool = ...) -> None: ...

class Runtime(_message.Message):
    __slots__ = ("device", "method", "cuda_graph", "summary")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPH_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    device: str
    method: PolarMethod
    cuda_graph: bool
    summary: str
    def __init__(self, device: _Optional[str] = ..., method: _Optional[_Union[PolarMethod, str]] = ..., cuda_graph: bool = ..., summary: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "state")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    state: JobState
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class Metrics(_message.Message):
    __slots__ = ("step", "total_steps", "reconstruction_error", "train_reconstruction_error", "free_energy_gap", "pseudo_log_likelihood", "log_likelihood", "log_likelihood_stderr", "log_likelihood_method", "spectral_norm", "wall_time_s", "samples_per_second", "saturated_hidden_fraction", "pt_swap_rate_min", "pt_swap_rate_mean", "pt_swap_rates", "lr", "log_likelihood_lower", "log_likelihood_lower_stderr")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    RECONSTRUCTION_ERROR_FIELD_NUMBER: _ClassVar[int]
    TRAIN_RECONSTRUCTION_ERROR_FIELD_NUMBER: _ClassVar[int]
    FREE_ENERGY_GAP_FIELD_NUMBER: _ClassVar[int]
    PSEUDO_LOG_LIKELIHOOD_FIELD_NUMBER: _ClassVar[int]
    LOG_LIKELIHOOD_FIELD_NUMBER: _ClassVar[int]
    LOG_LIKELIHOOD_STDERR_FIELD_NUMBER: _ClassVar[int]
    LOG_LIKELIHOOD_METHOD_FIELD_NUMBER: _ClassVar[int]
    SPECTRAL_NORM_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SATURATED_HIDDEN_FRACTION_FIELD_NUMBER: _ClassVar[int]
    PT_SWAP_RATE_MIN_FIELD_NUMBER: _ClassVar[int]
    PT_SWAP_RATE_MEAN_FIELD_NUMBER: _ClassVar[int]
    PT_SWAP_RATES_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    LOG_LIKELIHOOD_LOWER_FIELD_NUMBER: _ClassVar[int]
    LOG_LIKELIHOOD_LOWER_STDERR_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    reconstruction_error: float
    train_reconstruction_error: float
    free_energy_gap: float
    pseudo_log_likelihood: float
    log_likelihood: float
    log_likelihood_stderr: float
    log_likelihood_method: LogLikelihoodMethod
    spectral_norm: float
    wall_time_s: float
    samples_per_second: float
    saturated_hidden_fraction: float
    pt_swap_rate_min: float
    pt_swap_rate_mean: float
    pt_swap_rates: _containers.RepeatedScalarFieldContainer[float]
    lr: float
    log_likelihood_lower: float
    log_likelihood_lower_stderr: float
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ..., reconstruction_error: _Optional[float] = ..., train_reconstruction_error: _Optional[float] = ..., free_energy_gap: _Optional[float] = ..., pseudo_log_likelihood: _Optional[float] = ..., log_likelihood: _Optional[float] = ..., log_likelihood_stderr: _Optional[float] = ..., log_likelihood_method: _Optional[_Union[LogLikelihoodMethod, str]] = ..., spectral_norm: _Optional[float] = ..., wall_time_s: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., saturated_hidden_fraction: _Optional[float] = ..., pt_swap_rate_min: _Optional[float] = ..., pt_swap_rate_mean: _Optional[float] = ..., pt_swap_rates: _Optional[_Iterable[float]] = ..., lr: _Optional[float] = ..., log_likelihood_lower: _Optional[float] = ..., log_likelihood_lower_stderr: _Optional[float] = ...) -> None: ...

class Backoff(_message.Message):
    __slots__ = ("step", "rollback_step", "reason", "old_lr", "new_lr", "backoff", "max_backoffs")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OLD_LR_FIELD_NUMBER: _ClassVar[int]
    NEW_LR_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_FIELD_NUMBER: _ClassVar[int]
    MAX_BACKOFFS_FIELD_NUMBER: _ClassVar[int]
    step: int
    rollback_step: int
    reason: str
    old_lr: float
    new_lr: float
    backoff: int
    max_backoffs: int
    def __init__(self, step: _Optional[int] = ..., rollback_step: _Optional[int] = ..., reason: _Optional[str] = ..., old_lr: _Optional[float] = ..., new_lr: _Optional[float] = ..., backoff: _Optional[int] = ..., max_backoffs: _Optional[int] = ...) -> None: ...

class StateChange(_message.Message):
    __slots__ = ("state", "message", "attempt", "step")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    message: str
    attempt: int
    step: int
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., message: _Optional[str] = ..., attempt: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class StreamMetricsRequest(_message.Message):
    __slots__ = ("job_id", "after", "history_only")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    HISTORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after: str
    history_only: bool
    def __init__(self, job_id: _Optional[str] = ..., after: _Optional[str] = ..., history_only: bool = ...) -> None: ...

class MetricEvent(_message.Message):
    __slots__ = ("resume_token", "job_id", "time", "metrics", "state", "backoff")
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_FIELD_NUMBER: _ClassVar[int]
    resume_token: str
    job_id: str
    time: _timestamp_pb2.Timestamp
    metrics: Metrics
    state: StateChange
    backoff: Backoff
    def __init__(self, resume_token: _Optional[str] = ..., job_id: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metrics: _Optional[_Union[Metrics, _Mapping]] = ..., state: _Optional[_Union[StateChange, _Mapping]] = ..., backoff: _Optional[_Union[Backoff, _Mapping]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("shape", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReconstructRequest(_message.Message):
    __slots__ = ("job_id", "input", "k", "mean_field", "checkpoint_step", "seed")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    input: Tensor
    k: int
    mean_field: bool
    checkpoint_step: int
    seed: int
    def __init__(self, job_id: _Optional[str] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., k: _Optional[int] = ..., mean_field: bool = ..., checkpoint_step: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class ReconstructResponse(_message.Message):
    __slots__ = ("output", "checkpoint_step")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    checkpoint_step: int
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., checkpoint_step: _Optional[int] = ...) -> None: ...

class SampleHiddenRequest(_message.Message):
    __slots__ = ("job_id", "input", "mode", "checkpoint_step", "seed")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    input: Tensor
    mode: HiddenMode
    checkpoint_step: int
    seed: int
    def __init__(self, job_id: _Optional[str] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., mode: _Optional[_Union[HiddenMode, str]] = ..., checkpoint_step: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SampleHiddenResponse(_message.Message):
    __slots__ = ("output", "checkpoint_step")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    checkpoint_step: int
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., checkpoint_step: _Optional[int] = ...) -> None: ...

class DatasetHeader(_message.Message):
    __slots__ = ("shape", "dtype", "name", "sha256")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    name: str
    sha256: str
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., name: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class UploadDatasetRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: DatasetHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[DatasetHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadDatasetResponse(_message.Message):
    __slots__ = ("dataset_id", "shape", "size_bytes", "created")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    size_bytes: int
    created: bool
    def __init__(self, dataset_id: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., size_bytes: _Optional[int] = ..., created: bool = ...) -> None: ...

class ExportModelRequest(_message.Message):
    __slots__ = ("job_id", "checkpoint_step", "format")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    checkpoint_step: int
    format: ExportFormat
    def __init__(self, job_id: _Optional[str] = ..., checkpoint_step: _Optional[int] = ..., format: _Optional[_Union[ExportFormat, str]] = ...) -> None: ...

class ModelExportHeader(_message.Message):
    __slots__ = ("config_json", "step", "sha256", "size_bytes", "format")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    step: int
    sha256: str
    size_bytes: int
    format: ExportFormat
    def __init__(self, config_json: _Optional[str] = ..., step: _Optional[int] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., format: _Optional[_Union[ExportFormat, str]] = ...) -> None: ...

class ExportModelResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ModelExportHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[ModelExportHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class GetTrainingDefaultsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepSizeDefault(_message.Message):
    __slots__ = ("model", "variance", "optimizer", "lr", "source", "step_rule", "short_run_lr")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VARIANCE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEP_RULE_FIELD_NUMBER: _ClassVar[int]
    SHORT_RUN_LR_FIELD_NUMBER: _ClassVar[int]
    model: ModelKind
    variance: VarianceKind
    optimizer: OptimizerKind
    lr: float
    source: str
    step_rule: StepRule
    short_run_lr: float
    def __init__(self, model: _Optional[_Union[ModelKind, str]] = ..., variance: _Optional[_Union[VarianceKind, str]] = ..., optimizer: _Optional[_Union[OptimizerKind, str]] = ..., lr: _Optional[float] = ..., source: _Optional[str] = ..., step_rule: _Optional[_Union[StepRule, str]] = ..., short_run_lr: _Optional[float] = ...) -> None: ...

class TrainingDefaults(_message.Message):
    __slots__ = ("step_sizes", "short_run_steps", "long_run_steps", "example")
    STEP_SIZES_FIELD_NUMBER: _ClassVar[int]
    SHORT_RUN_STEPS_FIELD_NUMBER: _ClassVar[int]
    LONG_RUN_STEPS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_FIELD_NUMBER: _ClassVar[int]
    step_sizes: _containers.RepeatedCompositeFieldContainer[StepSizeDefault]
    short_run_steps: int
    long_run_steps: int
    example: StartTrainingRequest
    def __init__(self, step_sizes: _Optional[_Iterable[_Union[StepSizeDefault, _Mapping]]] = ..., short_run_steps: _Optional[int] = ..., long_run_steps: _Optional[int] = ..., example: _Optional[_Union[StartTrainingRequest, _Mapping]] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job_id", "force")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    force: bool
    def __init__(self, job_id: _Optional[str] = ..., force: bool = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class Dataset(_message.Message):
    __slots__ = ("dataset_id", "name", "shape", "dtype", "size_bytes", "created_at")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    size_bytes: int
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, dataset_id: _Optional[str] = ..., name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., size_bytes: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets", "next_page_token")
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[Dataset]
    next_page_token: str
    def __init__(self, datasets: _Optional[_Iterable[_Union[Dataset, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteDatasetRequest(_message.Message):
    __slots__ = ("dataset_id",)
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    def __init__(self, dataset_id: _Optional[str] = ...) -> None: ...

class DeleteDatasetResponse(_message.Message):
    __slots__ = ("dataset_id",)
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    def __init__(self, dataset_id: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "api", "python_version", "torch_version", "features")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    version: str
    api: str
    python_version: str
    torch_version: str
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[str] = ..., api: _Optional[str] = ..., python_version: _Optional[str] = ..., torch_version: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...

class SweepRange(_message.Message):
    __slots__ = ("low", "high", "scale")
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    low: float
    high: float
    scale: AxisScale
    def __init__(self, low: _Optional[float] = ..., high: _Optional[float] = ..., scale: _Optional[_Union[AxisScale, str]] = ...) -> None: ...

class SweepAxis(_message.Message):
    __slots__ = ("field", "values", "kinds", "range")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    field: str
    values: _containers.RepeatedScalarFieldContainer[float]
    kinds: _containers.RepeatedScalarFieldContainer[OptimizerKind]
    range: SweepRange
    def __init__(self, field: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ..., kinds: _Optional[_Iterable[_Union[OptimizerKind, str]]] = ..., range: _Optional[_Union[SweepRange, _Mapping]] = ...) -> None: ...

class EarlyStopping(_message.Message):
    __slots__ = ("rungs", "min_steps", "reduction_factor")
    RUNGS_FIELD_NUMBER: _ClassVar[int]
    MIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    REDUCTION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    rungs: _containers.RepeatedScalarFieldContainer[int]
    min_steps: int
    reduction_factor: int
    def __init__(self, rungs: _Optional[_Iterable[int]] = ..., min_steps: _Optional[int] = ..., reduction_factor: _Optional[int] = ...) -> None: ...

class StartSweepRequest(_message.Message):
    __slots__ = ("base", "axes", "mode", "samples", "seed", "rank_metric", "early_stopping", "name", "request_id", "validate_only", "seeds")
    BASE_FIELD_NUMBER: _ClassVar[int]
    AXES_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RANK_METRIC_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    base: StartTrainingRequest
    axes: _containers.RepeatedCompositeFieldContainer[SweepAxis]
    mode: SweepMode
    samples: int
    seed: int
    rank_metric: str
    early_stopping: EarlyStopping
    name: str
    request_id: str
    validate_only: bool
    seeds: int
    def __init__(self, base: _Optional[_Union[StartTrainingRequest, _Mapping]] = ..., axes: _Optional[_Iterable[_Union[SweepAxis, _Mapping]]] = ..., mode: _Optional[_Union[SweepMode, str]] = ..., samples: _Optional[int] = ..., seed: _Optional[int] = ..., rank_metric: _Optional[str] = ..., early_stopping: _Optional[_Union[EarlyStopping, _Mapping]] = ..., name: _Optional[str] = ..., request_id: _Optional[str] = ..., validate_only: bool = ..., seeds: _Optional[int] = ...) -> None: ...

class SweepRun(_message.Message):
    __slots__ = ("job_id", "point", "state", "step", "total_steps", "latest_metrics", "rank", "rank_value", "error", "expired")
    class PointEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LATEST_METRICS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_VALUE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    point: _containers.ScalarMap[str, str]
    state: JobState
    step: int
    total_steps: int
    latest_metrics: Metrics
    rank: int
    rank_value: float
    error: str
    expired: bool
    def __init__(self, job_id: _Optional[str] = ..., point: _Optional[_Mapping[str, str]] = ..., state: _Optional[_Union[JobState, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., latest_metrics: _Optional[_Union[Metrics, _Mapping]] = ..., rank: _Optional[int] = ..., rank_value: _Optional[float] = ..., error: _Optional[str] = ..., expired: bool = ...) -> None: ...

class Sweep(_message.Message):
    __slots__ = ("id", "name", "state", "request", "runs", "best_job_id", "created_at", "run_count", "cancel_requested")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    BEST_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    RUN_COUNT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    state: SweepState
    request: StartSweepRequest
    runs: _containers.RepeatedCompositeFieldContainer[SweepRun]
    best_job_id: str
    created_at: _timestamp_pb2.Timestamp
    run_count: int
    cancel_requested: bool
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[SweepState, str]] = ..., request: _Optional[_Union[StartSweepRequest, _Mapping]] = ..., runs: _Optional[_Iterable[_Union[SweepRun, _Mapping]]] = ..., best_job_id: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., run_count: _Optional[int] = ..., cancel_requested: bool = ...) -> None: ...

class GetSweepRequest(_message.Message):
    __slots__ = ("sweep_id",)
    SWEEP_ID_FIELD_NUMBER: _ClassVar[int]
    sweep_id: str
    def __init__(self, sweep_id: _Optional[str] = ...) -> None: ...

class ListSweepsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListSweepsResponse(_message.Message):
    __slots__ = ("sweeps", "next_page_token")
    SWEEPS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sweeps: _containers.RepeatedCompositeFieldContainer[Sweep]
    next_page_token: str
    def __init__(self, sweeps: _Optional[_Iterable[_Union[Sweep, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelSweepRequest(_message.Message):
    __slots__ = ("sweep_id",)
    SWEEP_ID_FIELD_NUMBER: _ClassVar[int]
    sweep_id: str
    def __init__(self, sweep_id: _Optional[str] = ...) -> None: ...

class StreamSweepRequest(_message.Message):
    __slots__ = ("sweep_id",)
    SWEEP_ID_FIELD_NUMBER: _ClassVar[int]
    sweep_id: str
    def __init__(self, sweep_id: _Optional[str] = ...) -> None: ...

class SweepUpdate(_message.Message):
    __slots__ = ("sweep", "time")
    SWEEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    sweep: Sweep
    time: _timestamp_pb2.Timestamp
    def __init__(self, sweep: _Optional[_Union[Sweep, _Mapping]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class DeleteSweepRequest(_message.Message):
    __slots__ = ("sweep_id", "force", "keep_runs")
    SWEEP_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    KEEP_RUNS_FIELD_NUMBER: _ClassVar[int]
    sweep_id: str
    force: bool
    keep_runs: bool
    def __init__(self, sweep_id: _Optional[str] = ..., force: bool = ..., keep_runs: bool = ...) -> None: ...

class DeleteSweepResponse(_message.Message):
    __slots__ = ("sweep_id", "deleted_jobs")
    SWEEP_ID_FIELD_NUMBER: _ClassVar[int]
    DELETED_JOBS_FIELD_NUMBER: _ClassVar[int]
    sweep_id: str
    deleted_jobs: int
    def __init__(self, sweep_id: _Optional[str] = ..., deleted_jobs: _Optional[int] = ...) -> None: ...
