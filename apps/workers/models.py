"""Workers: the GPU hosts whose daemons connect to the gateway, their tokens, resources and presence."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from datetime import timedelta

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models, transaction
from django.utils import timezone

from worker_daemon.protocol import BenchmarkResult, Device, ExecutorDescriptor, Resources

TOKEN_PREFIX = "hw_"


def new_token(prefix: str) -> str:
    """A bearer token: ``prefix`` (what kind of token it is) and 32 random bytes, URL-safe."""
    return prefix + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """Tokens are 32 random bytes, so an unsalted SHA-256 is enough to store them safely."""
    return hashlib.sha256(token.encode()).hexdigest()


class ResourceColumns(models.Model):
    """A resource vector as four columns (a worker's capacity, or what an advert, offer or lease holds)."""

    cpu = models.FloatField(default=0, help_text="CPU cores")
    memory = models.FloatField(default=0, help_text="memory, GB")
    storage = models.FloatField(default=0, help_text="storage, GB")
    gpu = models.FloatField(default=0, help_text="GPU memory, GB of VRAM")

    class Meta:
        abstract = True

    @property
    def resources(self) -> Resources:
        return Resources(cpu=self.cpu, memory=self.memory, storage=self.storage, gpu=self.gpu)

    def set_resources(self, resources: Resources) -> None:
        self.cpu, self.memory, self.storage, self.gpu = (
            resources.cpu,
            resources.memory,
            resources.storage,
            resources.gpu,
        )


class Reachable(models.TextChoices):
    """Whether a host accepts inbound connections at its public URL, as its daemon or data node declares it
    (``worker_daemon.protocol.Reachable``: true, false or "auto"; "auto" until it says)."""

    TRUE = "true", "reachable"
    FALSE = "false", "not reachable"
    AUTO = "auto", "auto (not said)"

    @classmethod
    def of(cls, declared: bool | str) -> Reachable:
        """The choice for a declared value: ``True``, ``False`` or ``"auto"``."""
        if isinstance(declared, bool):
            return cls.TRUE if declared else cls.FALSE
        return cls.AUTO


class Worker(ResourceColumns):
    class Status(models.TextChoices):
        ONLINE = "online", "online"
        OFFLINE = "offline", "offline"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="workers", null=True, blank=True
    )
    name = models.SlugField(max_length=100, unique=True)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    token_hint = models.CharField(max_length=16, editable=False, help_text="First characters of the token.")
    token_revoked_at = models.DateTimeField(null=True, blank=True)
    executors = models.JSONField(default=list, blank=True, help_text='[{"class": "train", "name": "…"}, …]')
    devices = models.JSONField(
        default=list,
        blank=True,
        help_text='Its devices (GPUs), as its daemon declares them: [{"index": 0, "memory": 24, "name": "…"}, …]',
    )
    price_floor = models.FloatField(default=0)
    strategy = models.CharField(max_length=16, default="whole")
    reachable = models.CharField(
        max_length=8,
        choices=Reachable.choices,
        default=Reachable.AUTO,
        help_text="Whether trainers can connect to its parameter server's public URL, as its daemon declares "
        "([parameter_server] reachable, --reachable).",
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OFFLINE)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    connected_at = models.DateTimeField(null=True, blank=True)
    channel_name = models.CharField(max_length=200, blank=True, editable=False)
    connection_info = models.JSONField(default=dict, blank=True)
    benchmark_score = models.FloatField(
        null=True,
        blank=True,
        help_text="Training samples per second on the standard benchmark workload (higher is faster); "
        "null until its daemon reports a benchmark.",
    )
    benchmark = models.JSONField(
        default=dict,
        blank=True,
        help_text="Details of the last benchmark (device, model, batch size, steps, median step seconds, "
        "slowdown, measured_at, …); 'error'/'error_at' when the latest run failed.",
    )
    # The operator's caps (blank: none). A daemon declares what it likes within the protocol's maxima; the
    # market counts no more than these (Worker.capacity), whatever the next hello says.
    max_cpu = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0)], help_text="Operator's cap: CPU cores"
    )
    max_memory = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0)], help_text="Operator's cap: memory, GB"
    )
    max_storage = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0)], help_text="Operator's cap: storage, GB"
    )
    max_gpu = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0)], help_text="Operator's cap: GPU memory, GB"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["status"])]

    def __str__(self) -> str:
        return self.name

    # --- tokens -------------------------------------------------------------------------------------

    @classmethod
    def create_with_token(cls, *, name: str, owner=None) -> tuple[Worker, str]:
        """Create a worker and return it with its token, which is shown once and stored only hashed."""
        token = new_token(TOKEN_PREFIX)
        worker = cls.objects.create(
            name=name, owner=owner, token_hash=hash_token(token), token_hint=token[:10]
        )
        return worker, token

    def rotate_token(self) -> str:
        """Issue a new token (un-revoking the worker); the old token stops working at once."""
        token = new_token(TOKEN_PREFIX)
        self.token_hash = hash_token(token)
        self.token_hint = token[:10]
        self.token_revoked_at = None
        self.save(update_fields=["token_hash", "token_hint", "token_revoked_at"])
        return token

    def revoke_token(self) -> bool:
        """Revoke the token; returns False if it was already revoked."""
        updated = Worker.objects.filter(pk=self.pk, token_revoked_at__isnull=True).update(
            token_revoked_at=timezone.now()
        )
        self.refresh_from_db(fields=["token_revoked_at"])
        return updated == 1

    @property
    def is_revoked(self) -> bool:
        return self.token_revoked_at is not None

    # --- presence -----------------------------------------------------------------------------------

    def mark_online(
        self,
        *,
        channel_name: str,
        resources: Resources,
        executors: list[ExecutorDescriptor],
        price_floor: float,
        strategy: str,
        info: dict,
        reachable: bool | str = "auto",
        devices: list[Device] | None = None,
    ) -> None:
        """Record a (re)connection; the newest connection wins the worker."""
        now = timezone.now()
        self.status = self.Status.ONLINE
        self.channel_name = channel_name
        self.connected_at = now
        self.last_seen_at = now
        self.set_resources(resources)
        self.executors = [descriptor.model_dump(by_alias=True) for descriptor in executors]
        self.devices = [device.model_dump() for device in devices or []]
        self.price_floor = price_floor
        self.strategy = strategy
        self.reachable = Reachable.of(reachable)
        self.connection_info = info
        self.save(
            update_fields=[
                "status",
                "channel_name",
                "connected_at",
                "last_seen_at",
                "cpu",
                "memory",
                "storage",
                "gpu",
                "executors",
                "devices",
                "price_floor",
                "strategy",
                "reachable",
                "connection_info",
            ]
        )

    def mark_offline(self, *, channel_name: str) -> bool:
        """Mark offline only if ``channel_name`` is still the worker's connection (a newer one may have won)."""
        with transaction.atomic():
            updated = Worker.objects.filter(pk=self.pk, channel_name=channel_name).update(
                status=self.Status.OFFLINE, channel_name="", last_seen_at=timezone.now()
            )
        return updated == 1

    def record_benchmark(self, result: BenchmarkResult) -> None:
        """Keep a finished benchmark: its score, and its details (a previous failure is forgotten)."""
        self.benchmark_score = result.score
        self.benchmark = result.model_dump(mode="json")
        self.save(update_fields=["benchmark_score", "benchmark"])

    def record_benchmark_failure(self, error: str) -> None:
        """Note that the latest benchmark failed; the last score stays (it is still the best estimate)."""
        self.benchmark = {**self.benchmark, "error": error, "error_at": timezone.now().isoformat()}
        self.save(update_fields=["benchmark"])

    def touch(self) -> None:
        Worker.objects.filter(pk=self.pk).update(last_seen_at=timezone.now())

    # --- resources ----------------------------------------------------------------------------------

    #: Model fields of the operator's caps, by resource.
    CAP_FIELDS = {"cpu": "max_cpu", "memory": "max_memory", "storage": "max_storage", "gpu": "max_gpu"}

    @property
    def capacity(self) -> Resources:
        """What the market counts: the resources its daemon declared, each at most the operator's cap."""
        return self.resources.capped(
            **{name: getattr(self, field) for name, field in self.CAP_FIELDS.items()}
        )

    def executor_keys(self) -> set[tuple[str, str]]:
        return {(item.get("class", ""), item.get("name", "")) for item in self.executors}

    def device_list(self) -> list[Device]:
        """Its devices as its daemon declared them (none for an older daemon or a ``gpu = N`` config)."""
        return [Device.model_validate(device) for device in self.devices]

    @property
    def reliability(self) -> float:
        """Its :attr:`WorkerRecord.reliability`; the prior for a worker without a record yet."""
        record = getattr(self, "record", None)  # the reverse one-to-one raises, getattr's default catches it
        return record.reliability if record is not None else RELIABILITY_PRIOR


#: The reliability of a worker with no record (docs/architecture.md, "Reputation"): neutral, half-way.
RELIABILITY_PRIOR = 0.5
#: How many events the prior weighs as: two, Laplace's rule of succession when the prior is one half.
RELIABILITY_PRIOR_WEIGHT = 2


class WorkerRecord(models.Model):
    """A worker's reputation: counters the workflows that know the events move (``apps.workers.reputation``).

    Counters, not aggregate queries over rounds and leases: a round's verdicts are a JSON map per round (no
    index reaches a worker's entries), and the market reads every candidate's reliability at each settlement.
    Only the workflows write these; the admin and the API show them read-only.
    """

    worker = models.OneToOneField(Worker, on_delete=models.CASCADE, primary_key=True, related_name="record")
    updates_accepted = models.PositiveIntegerField(
        default=0, help_text="Updates the parameter server averaged in full (or, unverified, averaged)."
    )
    updates_down_weighted = models.PositiveIntegerField(
        default=0, help_text="Updates the parameter server averaged with a reduced weight."
    )
    updates_rejected = models.PositiveIntegerField(
        default=0, help_text="Updates the parameter server rejected, or refused on arrival."
    )
    leases_completed = models.PositiveIntegerField(
        default=0, help_text="ACTIVE leases that lasted until their job ended."
    )
    leases_lost = models.PositiveIntegerField(
        default=0,
        help_text="ACTIVE leases that ended while their job went on: not renewed, given back, revoked, "
        "dropped by its daemon, or ended for repeatedly rejected updates.",
    )
    jobs_served = models.PositiveIntegerField(
        default=0, help_text="Jobs whose end its leases saw through (a job counts once per worker)."
    )
    results_lost = models.PositiveIntegerField(
        default=0,
        help_text="Inference results that lost a verification: another worker's computation of the same slice "
        "agreed with a third, and its own did not (docs/inference.md, Verification).",
    )
    speed_rounds = models.PositiveIntegerField(
        default=0, help_text="Rounds in which its speed against its benchmark was measured."
    )
    speed_vs_benchmark = models.FloatField(
        null=True,
        blank=True,
        help_text="Mean over those rounds of its samples/s per benchmark score, relative to its co-trainers' "
        "median in the same round (1: as fast as its benchmark predicts); null until measured.",
    )
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"record of worker {self.worker_id}"

    @property
    def successes(self) -> float:
        return self.updates_accepted + self.updates_down_weighted / 2 + self.leases_completed

    @property
    def events(self) -> int:
        return (
            self.updates_accepted
            + self.updates_down_weighted
            + self.updates_rejected
            + self.leases_completed
            + self.leases_lost
            + self.results_lost
        )

    @property
    def reliability(self) -> float:
        """The Bayesian-smoothed share of its events that went well, in (0, 1)::

            reliability = (accepted + down_weighted / 2 + leases_completed + k·p)
                          / (accepted + down_weighted + rejected + leases_completed + leases_lost
                             + results_lost + k)

        with the prior ``p`` = :data:`RELIABILITY_PRIOR` (0.5) weighing as ``k`` = :data:`RELIABILITY_PRIOR_WEIGHT`
        (2) events. A new worker is at 0.5; each accepted update or completed lease moves it up, each rejected
        (or refused) update, lost lease or lost inference result down, a down-weighted update counts half. It never reaches 0 or 1.
        """
        return (self.successes + RELIABILITY_PRIOR_WEIGHT * RELIABILITY_PRIOR) / (
            self.events + RELIABILITY_PRIOR_WEIGHT
        )


class CountedRound(models.Model):
    """A round whose report is in the workers' records: a parameter server's report sent again counts once."""

    round = models.OneToOneField("jobs.Round", on_delete=models.CASCADE, primary_key=True, related_name="+")

    def __str__(self) -> str:
        return f"counted {self.round_id}"


USER_TOKEN_PREFIX = "hu_"


class UserToken(models.Model):
    """A user's REST API token (``Authorization: Token <key>``), stored like a worker token: only its SHA-256
    and its first characters are kept, so the key is shown once, when it is issued, and a copy of the database
    authenticates no one. A user may hold several (one per machine or script); deleting one revokes it.

    It lives beside the worker tokens because it is built the same way; nothing of the workers depends on it.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    key_prefix = models.CharField(max_length=16, editable=False, help_text="First characters of the key.")
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)

    #: A request moves ``last_used_at`` only when it is older than this: one write a minute per token at most.
    LAST_USED_RESOLUTION_SECONDS = 60

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.key_prefix}… ({self.user})"

    @classmethod
    def issue(cls, user) -> tuple[UserToken, str]:
        """A new token for ``user`` and its key, which is returned once and stored only hashed."""
        key = new_token(USER_TOKEN_PREFIX)
        return cls.objects.create(user=user, key_hash=hash_token(key), key_prefix=key[:10]), key

    @classmethod
    def authenticate(cls, key: str) -> UserToken | None:
        """The token whose key is ``key`` (with its active user), or None; records when it was last used."""
        token = cls.objects.select_related("user").filter(key_hash=hash_token(key)).first()
        if token is None:
            return None
        now = timezone.now()
        stale = now - timedelta(seconds=cls.LAST_USED_RESOLUTION_SECONDS)
        # A conditional update: concurrent requests write at most once, and never under a lock.
        cls.objects.filter(pk=token.pk).filter(
            models.Q(last_used_at__isnull=True) | models.Q(last_used_at__lt=stale)
        ).update(last_used_at=now)
        return token
