"""The one argument model of the Ray Serve app. The CLI builds it from flags, the Helm chart
renders it into `serveConfigV2.applications[].args`; both validate against this class.

`AppArgs` is `DeploymentArgs` (replicas, parsers, router, canary, ...) plus one field per
`EngineConfig` setting, derived from the dataclass: engine settings are declared only there."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from service.deployments.limits import LimitArgs
from service.engine.config import EngineConfig
from service.engine.settings import settings_of

# handle-side queue bound (x max_ongoing_requests x replicas) -> 503; an engine replica refuses the grouped requests
# beyond (1 + this) x max_ongoing_requests the same way
QUEUED_REQUESTS_PER_REPLICA = 4


class RouterArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["prefix_aware", "default"] = "prefix_aware"
    w_prefix: float = Field(1.0, ge=0)  # weight of matched/total prefix fraction
    w_load: float = Field(0.5, ge=0)  # weight of normalised queue length
    max_load_imbalance: int = Field(8, ge=1)  # per-request gate: skip affinity if target has this many more in flight
    index_capacity_blocks: int = Field(200_000, ge=1)  # approximate index size per replica (blocks)


class CanaryArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    interval_s: float = Field(300.0, gt=0)  # seconds between canary runs on each replica
    audit_sample_rate: float = Field(0.01, ge=0, le=1)  # fraction of real prefix hits recomputed cold


class DeploymentArgs(BaseModel):
    """The Serve app's own arguments; `AppArgs` adds every `EngineConfig` setting to these."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    served_model_name: str | None = None  # default: basename of model_path
    replicas: int = Field(1, ge=1)  # engine replicas (fixed count unless autoscaling set)
    min_replicas: int | None = Field(None, ge=1)  # autoscaling lower bound
    max_replicas: int | None = Field(None, ge=1)  # autoscaling upper bound
    target_ongoing_requests: float = Field(32.0, gt=0)
    reasoning_parser: Literal["nemotron_3"] | None = None
    tool_call_parser: Literal["qwen3_coder"] | None = None
    router: RouterArgs = Field(default_factory=RouterArgs)
    canary: CanaryArgs = Field(default_factory=CanaryArgs)
    cpus_per_replica: float = Field(1.0, gt=0)
    max_ongoing_requests: int = Field(256, ge=1)  # per engine replica; beyond it requests get 503
    ingress_replicas: int = Field(1, ge=1)  # OpenAI ingress replicas (HTTP parsing, SSE, routing)
    # new tokens leave an engine replica in about this many chunks per second over all its streams: each stream
    # sends every (open streams / this) seconds (at most MAX_STREAM_INTERVAL_S), its first and last token at once
    stream_chunks_per_s: float = Field(500.0, gt=0)
    # requests one ingress -> engine Serve call carries at most (service/deployments/groups.py): requests that arrive
    # while the ingress replica's previous group call is being set up share the next call; 1: one call per request.
    # Grouping cuts the engine replica's CPU per request, which bounds how fast a wave of arrivals reaches the engine:
    # on one H200 it carried 1.00-1.14x of in-process where one call per request carried 0.82-1.02x (S2)
    group_max_requests: int = Field(64, ge=1)
    # Ray Serve's access log line per call of the ingress and engine replicas (one per HTTP request and one per
    # engine call); off, a burst of calls is not slowed by formatting and writing a log record for each
    access_log: bool = False
    route_prefix: str = "/"
    api_keys_file: str | None = Field(
        None,
        description="file with the accepted API keys, one per line (the keys in HYBRID_SERVE_API_KEYS are "
        "accepted too); no keys at all: /v1/* is open",
    )
    limits: LimitArgs = Field(default_factory=LimitArgs)

    @model_validator(mode="after")
    def _check(self) -> DeploymentArgs:
        self.engine_config().validate()
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self

    def engine_config(self) -> EngineConfig:
        """The engine settings of these arguments (device "auto" is resolved by the engine on its replica)."""
        return EngineConfig(**{s.name: getattr(self, s.name) for s in settings_of(EngineConfig)})

    @property
    def gpus_per_replica(self) -> int:
        """One GPU per tensor-parallel rank (ep reuses the same ranks); 0 on CPU."""
        return self.tp if self.device != "cpu" else 0


def _engine_fields() -> dict[str, Any]:
    """Pydantic field definitions of the `EngineConfig` settings (checks: `EngineConfig.validate`)."""
    out: dict[str, Any] = {}
    for s in settings_of(EngineConfig):
        annotation = s.type | None if s.optional else s.type
        default = ... if s.required else s.default
        out[s.name] = (annotation, Field(default, description=s.help))
    return out


AppArgs = create_model("AppArgs", __base__=DeploymentArgs, __module__=__name__, **_engine_fields())
AppArgs.__doc__ = "Arguments of `service.deployments.app:build_app`: DeploymentArgs plus every EngineConfig setting."
