"""The appliance's settings sections: one dataclass per TOML section, with the defaults and why.

Loading, environment overrides and the cross-field checks are in edgeserve/config.py, which re-exports
every name here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edgeserve.protocol.restricted import RestrictedGroups


class ConfigError(ValueError):
    """A settings error; the message names the source, the field and what to do."""


@dataclass
class ServerSection:
    model_repository: Path = Path("models")  # the Triton-layout folder of models to serve
    # "explicit": load `load_models` at start (["*"] = everything) and allow load/unload at run time.
    # "none": load everything at start, refuse the load/unload API (Triton's default mode).
    model_control_mode: str = "explicit"
    load_models: list[str] = field(default_factory=lambda: ["*"])  # models loaded at start; "*" = all
    strict_readiness: bool = True  # ready = every model ready (else: the server is up)
    exit_timeout_s: float = 30.0  # drain budget on SIGTERM
    # Inference requests in flight at once, all frontends together; more are refused at once
    # (HTTP 503, gRPC UNAVAILABLE, ZeroMQ UNAVAILABLE) before their tensors are read.
    # 0 = twice what the models' queues take (their wait-bounded caps).
    max_inflight: int = 0
    # Response cache bound in MB (Triton's --cache-config local,size=...), shared by the models whose
    # config.pbtxt says `response_cache { enable: true }`; others never cache. 0 = no cache at all.
    cache_mb: int = 16
    state_dir: Path = Path("/var/lib/edgeserve")  # runtime plan, caches, bundles, fleet state
    # "auto": uvloop where it is installed, else asyncio's own loop; "uvloop" insists; "asyncio" never.
    event_loop: str = "auto"


@dataclass
class RepositorySection:
    memory_budget_mb: int = 0  # memory the models may hold together; 0 = the device's (hardware probe)
    load_wait_s: float = 60.0  # a request waits this long for a load on first use (its timeout if less)
    # Files sent with one load request (Triton's `file:<version>/<name>` parameters), in bytes once
    # decoded, all together (512 MiB). They are held in memory, then written to disk; a larger model
    # belongs in the model repository or a signed bundle. The request must also fit [http]
    # max_input_bytes (base64 adds a third) or [grpc] max_message_bytes.
    load_files_max_bytes: int = 512 * 2**20
    load_file_max_bytes: int = 256 * 2**20  # Each file of one load request, decoded (256 MiB)


@dataclass
class HttpSection:
    enabled: bool = True  # false: no HTTP listener (the supervisor still reaches the server privately)
    host: str = "127.0.0.1"  # "0.0.0.0" serves the LAN: set token and TLS first
    port: int = 8000  # 0 picks a free port
    # Request body limit (also decompressed); 0 = sized for the device (edgeserve/frontends/limits.py).
    max_input_bytes: int = 0
    max_connections: int = 512  # open connections in all; more are answered 503 and closed
    max_connections_per_client: int = 64  # per peer address
    # A request's headers (and a started body) must arrive within this: a slowloris peer is closed.
    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = 15.0  # an idle keep-alive connection is closed after this
    # Run a request on the event loop itself when its model's recent compute time is under this and
    # an instance is idle (two thread hand-offs saved; the loop waits that long); 0 = always hand off.
    inline_max_us: int = 100
    tls_cert: Path | None = None  # HTTPS when tls_cert and tls_key are set
    tls_key: Path | None = None  # PEM private key of tls_cert
    tls_client_ca: Path | None = None  # and clients must show a certificate from this CA (mutual TLS)
    # Access as [grpc] (frontends/access.py): token for non-loopback peers (env EDGESERVE_HTTP_TOKEN),
    # admin endpoints from loopback only, Triton's --http-restricted-api groups.
    token: str = ""
    admin_loopback_only: bool = True  # load/unload, shm register/unregister, POST /v2/logging: loopback only
    restricted_api: RestrictedGroups = field(default_factory=RestrictedGroups)  # ["model-repository:key=v"]


@dataclass
class GrpcSection:
    enabled: bool = True  # false: no gRPC listener
    host: str = "127.0.0.1"  # "0.0.0.0" serves the LAN: set token and TLS first
    port: int = 8001  # 0 picks a free port
    max_message_bytes: int = 0  # 0 = sized for the device, as [http] max_input_bytes
    max_concurrent_rpcs: int = 1024  # RPCs (streams included) at once; more get RESOURCE_EXHAUSTED
    stream_idle_timeout_s: float = 300.0  # a ModelStreamInfer stream with nothing in flight is ended
    connection_idle_timeout_s: float = 900.0  # a connection with no RPC this long is closed (GOAWAY)
    keepalive_s: float = 60.0  # ping period: a half-open connection is found within this + 20 s
    inline_max_us: int = 100  # as [http] inline_max_us (ModelInfer and ModelStreamInfer)
    tls_cert: Path | None = None  # gRPC over TLS when tls_cert and tls_key are set
    tls_key: Path | None = None  # PEM private key of tls_cert
    tls_client_ca: Path | None = None  # and clients must show a certificate from this CA (mutual TLS)
    # Bearer token required from non-loopback peers ("" = none). Env: EDGESERVE_GRPC_TOKEN.
    token: str = ""
    admin_loopback_only: bool = True  # load/unload, shm register/unregister, log settings: loopback only
    restricted_protocol: RestrictedGroups = field(default_factory=RestrictedGroups)  # Triton's groups


@dataclass
class MetricsSection:
    """Triton's metrics port: the `/metrics` page of the HTTP port (same access rules) on its own listener."""

    # Triton's --metrics-port. 0 = no metrics listener (the HTTP port still serves /metrics). A port in
    # use is logged and the server serves on without it: metrics never keep inference down.
    port: int = 8002
    address: str = "127.0.0.1"  # "0.0.0.0" serves the LAN: plain HTTP; [http] token applies to it


MAX_SPIN_US = 10_000


@dataclass
class ZmqSection:
    enabled: bool = True  # false: no ZeroMQ socket
    # ipc:// or tcp://; [] = the default ipc socket, in a folder only the service user can write:
    # $RUNTIME_DIRECTORY (systemd), else $XDG_RUNTIME_DIR/edgeserve, else <state_dir>/run
    endpoints: list[str] = field(default_factory=list)
    max_inflight_per_client: int = 256  # requests of one client socket in flight; more are refused
    max_message_bytes: int = 0  # per request, all frames; 0 = sized for the device, as HTTP and gRPC
    max_clients: int = 256  # client sockets known at once; a new one past this is refused
    # Run a request on the ZeroMQ thread itself (no hand-off to a worker) when its model's recent
    # compute time is under this and an instance is idle; 0 = always hand off.
    inline_max_us: int = 2000
    # After a request, poll the socket (yielding the core) this long before sleeping, while requests
    # have been arriving that close together; 0 = always sleep at once. Spares the wake-ups that
    # dominate a small model's round trip on a VM; an idle or slowly fed server never spins.
    spin_us: int = 200


@dataclass
class ShmSection:
    allow_client_shm: bool = True  # false: clients may not register shared memory at all
    # Only keys starting with one of these may be registered ([] = any key).
    key_prefixes: list[str] = field(default_factory=list)
    max_regions: int = 1024  # registered regions at once, all clients together
    # Whose memory a client may register: "peer-credentials" (a local client only memory it could
    # open itself, found by its socket's credentials; any other client only objects of the server's
    # user or group, or key_prefixes) or "triton" (anything the server's user can open, as Triton).
    registration: str = "peer-credentials"


@dataclass
class RuntimeSection:
    cpu_threads: int = 0  # 0 = from the CPU budget (cgroup-aware)
    default_max_batch_size: int = 4  # Triton's auto-complete default
    # ONNX Runtime's arena keeps a call's peak activations (RSS for speed); unset: the memory profile's
    # (standard: on for models without dynamic dims beyond the batch axis; small: off)
    ort_memory_arena: bool | None = None
    ort_allow_spinning: bool = False  # spinning threads burn an idle edge box's CPU
    # auto, small or standard: the runtimes' memory settings (docs/appliance.md). small trades some
    # speed for memory (no OpenVINO for dynamic-shape CPU models); auto = small on a device with <= 4 GiB.
    memory_profile: str = "auto"
    openvino_performance_hint: str = "LATENCY"  # LATENCY, THROUGHPUT or CUMULATIVE_THROUGHPUT
    # Precisions the plan may choose (fp32, fp16, bf16, int8); lower ones still pass the accuracy guard.
    allowed_precisions: list[str] = field(default_factory=lambda: ["fp32", "fp16", "bf16"])
    accuracy_tolerance: float = 1e-2  # max error (share of each output's range) a lower precision may add
    race_budget_s: float = 6.0  # load-time race of the viable runtimes per model (0 = the profile's rule)
    # finish a provisional race (budget ran out, or a noisy near tie) in the background and switch
    race_background: bool = True
    # where a config leaves max_batch_size open, the race times its winner at batch 1, 2, 4 ... up to this
    # and serves the knee (at most 256; 0 or 1: auto-complete's default_max_batch_size, unmeasured)
    race_max_batch_size: int = 16
    cache_dir: Path | None = None  # compiled models, engines, race results; unset = <state_dir>/cache
    device_profiles: Path | None = None  # extra folder of device profile TOMLs
    hardware_root: Path = Path("/")  # where the hardware probe reads /proc and /sys (tests, fixtures)


@dataclass
class LoggingSection:
    level: str = "INFO"  # DEBUG, INFO, WARNING or ERROR
    format: str = "text"  # text | json
    # A rotated log file; empty = stderr (journald under systemd adds its own bounds and timestamps).
    file: Path | None = None
    max_bytes: int = 10 * 2**20  # per log file before it rotates
    backups: int = 3  # rotated files kept


@dataclass
class SupervisorSection:
    """`edgeserve run`: the process that keeps the server alive (not used by `edgeserve serve`)."""

    restart_initial_s: float = 1.0  # first restart delay after a crash; doubles per crash
    restart_max_s: float = 60.0  # cap of that delay
    stable_after_s: float = 120.0  # a server up this long resets the delay
    health_interval_s: float = 2.0  # health check period (watchdog pings need a fresh answer)
    health_timeout_s: float = 2.0  # a health check not answered within this counts as missed
    # Server alive but not answering its health check this long -> killed and restarted (0 = never;
    # under systemd the watchdog restarts the whole service sooner).
    hang_timeout_s: float = 60.0
    max_rss_mb: int = 0  # server RSS above this for 3 checks in a row -> graceful restart (0 = off)


@dataclass
class OtaSection:
    """Signed model bundles (`edgeserve bundle install`, the fleet agent)."""

    trial_window_s: float = 10.0  # health checks on the new models before (and after) the switch
    load_timeout_s: float = 900.0  # loading + warming up a bundle's models (engine builds are slow)
    max_unpacked_mb: int = 16384  # larger bundles are refused whatever they declare
    crash_rollback_restarts: int = 3  # server crashes soon after a switch that roll the bundle back
    # Memory a trial beside the serving models may take; 0 = what the kernel says is available. Too
    # little for a second copy -> drain, unload, load in place (the downtime is reported).
    trial_memory_mb: int = 0
    # Trusted keys: bundles/*.pub sign bundles, commands/*.pub sign fleet commands (edgeserve/ota/trust.py).
    # Unset = <state_dir>/trust; the systemd install uses /etc/edgeserve/trust (read-only to the service).
    trust_dir: Path | None = None
    # Fleet-initiated downloads (deploy_bundle, desired state): http(s) only, never to this device's
    # loopback or link-local addresses (cloud metadata included). Operator installs are not limited.
    allow_file_urls: bool = False  # also file:// URLs and local paths
    allow_loopback_urls: bool = False  # also 127/8, ::1, 0.0.0.0 (labs, tests)
    allow_link_local_urls: bool = False  # also 169.254/16, fe80::/10 (a mirror on a direct cable)


MAX_COMMAND_LIFETIME_S = 30 * 86400  # [fleet] max_command_lifetime_s may not be set above this


@dataclass
class FleetSection:
    """The MQTT fleet agent (in the supervisor). No broker = no agent."""

    broker: str = ""  # mqtt://host:1883 or mqtts://host:8883
    fleet: str = "default"  # the fleet's topic level: es/v1/{fleet}/{device}/...
    device_id: str = ""  # "" = the hostname
    username: str = ""  # broker login, with password
    password: str = ""  # env: EDGESERVE_FLEET_PASSWORD
    ca_file: Path | None = None  # CA that signed the broker's certificate (mqtts://)
    cert_file: Path | None = None  # client certificate (mutual TLS), with key_file
    key_file: Path | None = None  # PEM private key of cert_file
    # "5" or "3.1.1" (the es/v1 command surface), or "aws-iot-jobs": commands arrive as AWS IoT Jobs on
    # $aws/things/{device_id}/jobs/... (MQTT 3.1.1, thing name = device_id), see docs/fleet-operations.md.
    protocol: str = "5"
    keepalive_s: int = 30  # MQTT keepalive (at least 5)
    metrics_interval_s: float = 60.0  # period of the metrics topic
    max_queued_commands: int = 8  # long commands waiting behind the running one; more are rejected
    # Signed commands (docs/fleet-operations.md): the folder of trusted command public keys, one PEM per *.pub
    # (not the bundle keys); unset = <state_dir>/trust/commands.
    command_keys: Path | None = None
    require_signed_commands: bool = True  # false: a lab opt-out; what is signed is still verified
    max_command_lifetime_s: float = 86400.0  # a command whose expires_at - issued_at is longer is refused
