"""The scheduler's queue: priority levels, each with Triton's queue policy (size cap, timeout,
REJECT or DELAY), and shape-aware batch selection. Not thread-safe: the scheduler holds its lock
around every call.

Order: level 1 (highest) first; inside a level, jobs in arrival order, then the jobs whose timeout
expired under the DELAY action (Triton's `delayed_queue_`), then the next level.

Overload: a level holds at most `max_queue_size` jobs, and, unless the config set that size itself,
no more than the scheduler's `soft_cap` (what the instances can work off in `MAX_QUEUE_WAIT_S`), so
the wait of an accepted job stays bounded. A full level is shared fairly between clients
(`Job.client`): a job from a client holding fewer queued jobs than the heaviest one takes the
heaviest client's newest job's place (that job is rejected), so one flooding camera cannot starve
the others; otherwise the new job is rejected with UNAVAILABLE at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgeserve.protocol.errors import InferenceError, Status, invalid_arg
from edgeserve.scheduling.job import Job

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

# Jobs a level may hold when its policy sets no max_queue_size (0 = "unlimited" in Triton): an
# appliance must not grow without bound under overload, so the cap turns overload into UNAVAILABLE.
DEFAULT_HARD_QUEUE_CAP = 1024

QUEUE_FULL_MESSAGE = "Exceeds maximum queue size"
TIMEOUT_MESSAGE = "Request timeout expired"


# What a model's queue may hold when its config sets no max_queue_size: jobs its instances can work
# off in this long (measured compute time per job), so at any overload an accepted request waits at
# most about this long and the rest are refused at once.
MAX_QUEUE_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy, with the hard cap folded into `max_queue_size`."""

    delay_on_timeout: bool = False  # timeout_action DELAY (True) or REJECT (False, Triton's default)
    default_timeout_us: int = 0  # 0 = no timeout
    allow_timeout_override: bool = False
    max_queue_size: int = DEFAULT_HARD_QUEUE_CAP
    explicit_size: bool = False  # the config set max_queue_size: no wait-based soft cap

    @classmethod
    def from_proto(cls, policy: Any, hard_cap: int = DEFAULT_HARD_QUEUE_CAP) -> QueuePolicy:
        limit = int(policy.max_queue_size)
        return cls(
            delay_on_timeout=int(policy.timeout_action) == 1,  # ModelQueuePolicy.DELAY
            default_timeout_us=int(policy.default_timeout_microseconds),
            allow_timeout_override=bool(policy.allow_timeout_override),
            max_queue_size=min(limit, hard_cap) if limit > 0 else hard_cap,
            explicit_size=limit > 0,
        )

    def effective_timeout_us(self, requested_us: int) -> int:
        """The request's own timeout when it may override (or there is no default), else the default."""
        if requested_us > 0 and (self.allow_timeout_override or self.default_timeout_us == 0):
            return requested_us
        return self.default_timeout_us


class _Level:
    __slots__ = ("clients", "delayed", "jobs", "policy")

    def __init__(self, policy: QueuePolicy) -> None:
        self.policy = policy
        self.jobs: deque[Job] = deque()
        self.delayed: deque[Job] = deque()
        self.clients: dict[str, int] = {}  # queued jobs per client

    def __len__(self) -> int:
        return len(self.jobs) + len(self.delayed)

    def count(self, job: Job) -> None:
        self.clients[job.client] = self.clients.get(job.client, 0) + 1

    def uncount(self, job: Job) -> None:
        left = self.clients.get(job.client, 0) - 1
        if left > 0:
            self.clients[job.client] = left
        else:
            self.clients.pop(job.client, None)

    def evict_for(self, client: str) -> Job | None:
        """Make room for a job of `client` in a full level: the newest job of the client holding the
        most queued jobs, when that is at least two more than `client` holds (max-min fairness)."""
        if len(self.clients) < 2 and client in self.clients:
            return None
        heaviest, most = max(self.clients.items(), key=lambda item: item[1], default=("", 0))
        if heaviest == client or most <= self.clients.get(client, 0) + 1:
            return None
        for queue in (self.delayed, self.jobs):  # delayed jobs (timed out, DELAY) are the stalest
            for i in range(len(queue) - 1, -1, -1):
                victim = queue[i]
                if victim.client == heaviest:
                    del queue[i]
                    self.uncount(victim)
                    return victim
        return None  # pragma: no cover - the counts say it is there


class JobQueue:
    """Priority levels of FIFO queues: `policies[i]` is level i+1's policy. With `priorities` False
    (the model sets no priority_levels) there is one level and request priorities are ignored."""

    def __init__(self, policies: list[QueuePolicy], default_level: int = 1, priorities: bool = True) -> None:
        if not policies:
            raise ValueError("a queue needs at least one level")
        self._levels = [_Level(p) for p in policies]
        self.default_level = default_level
        self.priorities = priorities
        self._size = 0
        self._next_deadline_ns = 0  # lowest queued deadline (may be stale-low; 0 = none)

    @classmethod
    def from_config(cls, config: ModelConfig, hard_cap: int = DEFAULT_HARD_QUEUE_CAP) -> JobQueue:
        if not config.HasField("dynamic_batching"):
            # No queue policy: the request's own timeout (if any) applies, with REJECT.
            return cls([QueuePolicy(max_queue_size=hard_cap)], priorities=False)
        batching = config.dynamic_batching
        default = QueuePolicy.from_proto(batching.default_queue_policy, hard_cap)
        levels = int(batching.priority_levels)
        if levels == 0:
            return cls([default], priorities=False)
        default_level = int(batching.default_priority_level)
        if not 1 <= default_level <= levels:
            raise invalid_arg(
                f"default_priority_level {default_level} must be in [1, {levels}] (priority_levels) "
                f"for model '{config.name}'"
            )
        policies = []
        for level in range(1, levels + 1):
            if level in batching.priority_queue_policy:
                policies.append(QueuePolicy.from_proto(batching.priority_queue_policy[level], hard_cap))
            else:
                policies.append(default)
        return cls(policies, default_level, priorities=True)

    # -- size -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._size

    @property
    def priority_levels(self) -> int:
        return len(self._levels)

    @property
    def next_deadline_ns(self) -> int:
        return self._next_deadline_ns

    # -- enqueue ----------------------------------------------------------------------------------
    def level_of(self, priority: int) -> int:
        """The level (1-based) a request priority maps to; raises INVALID_ARG when out of range."""
        if not self.priorities:
            return 1  # priorities off: every request shares the one level (Triton ignores the value)
        if priority == 0:
            return self.default_level
        if not 1 <= priority <= len(self._levels):
            raise invalid_arg(
                f"priority {priority} is out of range: the model has priority levels 1..{len(self._levels)} "
                "(0 = default)"
            )
        return priority

    def would_refuse(self, client: str, soft_cap: int = 0) -> bool:
        """Whether a job of `client` at the default level would be refused now (full level, no
        heavier client to make room). A hint read without the scheduler's lock, for refusing before a
        request is decoded; `push` still decides exactly. Only for models without priority levels."""
        if self.priorities:
            return False
        entry = self._levels[0]
        limit = entry.policy.max_queue_size
        if soft_cap > 0 and not entry.policy.explicit_size and soft_cap < limit:
            limit = soft_cap
        if len(entry) < limit:
            return False
        try:
            counts = list(entry.clients.values())
        except RuntimeError:  # resized by a push on another thread: let push decide
            return False
        return not counts or max(counts) <= entry.clients.get(client, 0) + 1

    def push(self, job: Job, level: int, now_ns: int, soft_cap: int = 0) -> Job | None:
        """Queue `job` at `level`; sets its deadline. A full level (`max_queue_size`, or `soft_cap`
        > 0 unless the config set the size) either makes room by evicting a heavier client's newest
        job, returned for the caller to fail, or raises UNAVAILABLE."""
        entry = self._levels[level - 1]
        evicted: Job | None = None
        limit = entry.policy.max_queue_size
        if soft_cap > 0 and not entry.policy.explicit_size and soft_cap < limit:
            limit = soft_cap
        if len(entry) >= limit:
            evicted = entry.evict_for(job.client)
            if evicted is None:
                raise InferenceError(Status.UNAVAILABLE, QUEUE_FULL_MESSAGE)
            self._size -= 1
        timeout_us = entry.policy.effective_timeout_us(job.timeout_us)
        job.deadline_ns = job.arrival_ns + timeout_us * 1000 if timeout_us > 0 else 0
        job.enqueue_ns = now_ns
        entry.jobs.append(job)
        entry.count(job)
        self._size += 1
        if job.deadline_ns and (self._next_deadline_ns == 0 or job.deadline_ns < self._next_deadline_ns):
            self._next_deadline_ns = job.deadline_ns
        return evicted

    # -- timeouts ---------------------------------------------------------------------------------
    def expire(self, now_ns: int) -> list[Job]:
        """Apply timeouts at `now_ns`: REJECT jobs are removed and returned (the caller fails them),
        DELAY jobs move behind their level's live jobs. Cheap unless a deadline has passed."""
        if self._next_deadline_ns == 0 or now_ns < self._next_deadline_ns:
            return []
        rejected: list[Job] = []
        next_deadline = 0
        for entry in self._levels:
            if not entry.jobs:
                continue
            keep: deque[Job] = deque()
            for job in entry.jobs:
                if job.deadline_ns and job.deadline_ns <= now_ns:
                    job.deadline_ns = 0
                    if entry.policy.delay_on_timeout:
                        entry.delayed.append(job)
                    else:
                        rejected.append(job)
                        entry.uncount(job)
                        self._size -= 1
                    continue
                keep.append(job)
                if job.deadline_ns and (next_deadline == 0 or job.deadline_ns < next_deadline):
                    next_deadline = job.deadline_ns
            entry.jobs = keep
        self._next_deadline_ns = next_deadline
        return rejected

    # -- dequeue ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Job]:
        for entry in self._levels:
            yield from entry.jobs
            yield from entry.delayed

    def head(self) -> Job | None:
        return next(iter(self), None)

    def select(self, max_rows: int) -> tuple[list[Job], int, bool]:
        """The next batch, left queued: the head job plus later jobs with its `shape_key`, in queue
        order, up to `max_rows` rows (max_rows <= 0: the head alone). Returns (jobs, rows, full) where
        `full` means no more rows can join (max reached or the next compatible job does not fit)."""
        it = iter(self)
        head = next(it, None)
        if head is None:
            return [], 0, False
        jobs, rows = [head], head.batch_size
        if max_rows <= 0 or rows >= max_rows:
            return jobs, rows, True
        key = head.shape_key
        for job in it:
            if job.shape_key != key:
                continue  # incompatible shapes wait for a batch of their own
            if rows + job.batch_size > max_rows:
                return jobs, rows, True
            jobs.append(job)
            rows += job.batch_size
            if rows >= max_rows:
                return jobs, rows, True
        return jobs, rows, False

    def remove(self, jobs: list[Job]) -> list[Job]:
        """Take `jobs` (from `select`, or any: those not queued are skipped) out of the queue; the
        ones that were queued."""
        wanted = {id(job) for job in jobs}
        left = len(wanted)
        removed: list[Job] = []
        for entry in self._levels:
            for attr in ("jobs", "delayed"):
                if not left:
                    break
                queue: deque[Job] = getattr(entry, attr)
                while queue and left and id(queue[0]) in wanted:
                    job = queue.popleft()
                    entry.uncount(job)
                    removed.append(job)
                    left -= 1
                if left and queue and any(id(job) in wanted for job in queue):
                    kept: deque[Job] = deque()
                    for job in queue:
                        if id(job) in wanted:
                            entry.uncount(job)
                            removed.append(job)
                        else:
                            kept.append(job)
                    left -= len(queue) - len(kept)
                    setattr(entry, attr, kept)
        self._size -= len(removed)
        return removed

    def pop_all(self) -> list[Job]:
        jobs = list(self)
        for entry in self._levels:
            entry.jobs.clear()
            entry.delayed.clear()
            entry.clients.clear()
        self._size = 0
        self._next_deadline_ns = 0
        return jobs
