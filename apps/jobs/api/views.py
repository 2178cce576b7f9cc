"""The jobs API: submit, list, inspect and cancel DiLoCo jobs. Users see their own jobs; staff see every job."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db.models import Prefetch, QuerySet
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action, api_view, renderer_classes
from rest_framework.exceptions import NotFound, ParseError, ValidationError
from rest_framework.parsers import BaseParser
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.jobs import metrics, services, spec, training
from apps.jobs.api.schema import DiLoCoSubmission
from apps.jobs.api.serializers import (
    JobCreateSerializer,
    JobDetailSerializer,
    JobMetricsSerializer,
    JobSerializer,
    JobSubmittedSerializer,
    UploadSerializer,
)
from apps.jobs.exceptions import (
    JobNotCancellable,
    RoundNotDiscardable,
    SpecError,
    SpecUnreadable,
    TransferRefused,
)
from apps.jobs.models import Job, Round, Task, Upload
from apps.jobs.training.discard import request_discard
from apps.jobs.training.uploads import delete_upload
from apps.leases.models import Lease
from hypha_site.api import error_responses
from hypha_site.parsers import BoundedJSONParser, read_bounded
from hypha_site.streaming import file_response, request_chunks
from worker_daemon.bounded_json import hostile_string_problem

INVALID_JOB_EXAMPLE = OpenApiExample(
    "invalid submission",
    value={
        "num_trainers": ["Ensure this value is less than or equal to 256."],
        "trainer": {
            "resources": {"gpu": ["Ensure this value is greater than or equal to 0."]},
            "price": {"max": ["Must be at least the bid (150)."]},
        },
        "spec": ['Expected a dictionary of items but got type "list".'],
    },
    response_only=True,
    status_codes=["400"],
)


class TomlParser(BaseParser):
    """A Hypha scheduler TOML document as text (``Content-Type: application/toml``)."""

    media_type = "application/toml"

    def parse(self, stream, media_type=None, parser_context=None) -> str:
        # Bounded here: DRF hands its JSON and form parsers Django's size-checked body, others the raw stream.
        data = read_bounded(stream, settings.HYPHA_MAX_TOML_BYTES)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ParseError(f"TOML must be UTF-8: {error}") from None


def spec_error_body(error: SpecError) -> dict[str, list[str]]:
    """A :class:`SpecError` as a 400 body like every other: each field (a dotted path) with its messages."""
    body: dict[str, list[str]] = {}
    for item in error.errors:
        body.setdefault(item["field"] or "non_field_errors", []).append(item["message"])
    return body


DILOCO_EXAMPLE = {
    "name": "tiny-gpt",
    "model": {
        "source": {"type": "huggingface", "repository": "hypha-space/lenet", "filenames": ["config.json"]},
        "type": "causal-lm",
        "input_names": ["input_ids", "labels"],
    },
    "dataset": {"name": "tiny-text"},
    "inner_optimizer": {"learning_rate": 0.001},
    "outer_optimizer": {"learning_rate": 0.7, "momentum": 0.9},
    "rounds": {"update_rounds": 10, "inner_steps": 50},
    "num_trainers": 2,
}


@extend_schema_view(
    list=extend_schema(
        summary="List jobs",
        description="Your jobs (staff: every job), newest first, a page at a time (`limit`, `offset`); "
        "`status` keeps the jobs in that status, `name` those whose name contains the text (any case).",
        parameters=[
            OpenApiParameter(
                "status", OpenApiTypes.STR, enum=Job.Status.values, description="only this status"
            ),
            OpenApiParameter("name", OpenApiTypes.STR, description="only names containing this (any case)"),
        ],
        responses={200: JobSerializer, **error_responses(400, 401)},
    ),
    retrieve=extend_schema(
        summary="Show a job, its leases and its status history",
        responses={200: JobDetailSerializer, **error_responses(401, 404)},
    ),
    create=extend_schema(
        summary="Submit a job",
        description=(
            "Creates the job (PENDING) and queues its allocation: each role is advertised to the market. "
            "Every role block and every field in it is optional and has a default; unknown fields are refused, "
            "so a misspelt field cannot silently fall back to its default. The 201's `warnings` say when the "
            "connected workers cannot serve a role now (the job is accepted all the same: workers may connect); "
            "a job not fully allocated within `allocation_timeout` seconds gives back its leases and fails."
        ),
        request=JobCreateSerializer,
        responses={201: JobSubmittedSerializer, **error_responses(400, 401, examples=[INVALID_JOB_EXAMPLE])},
    ),
)
class JobViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin, viewsets.GenericViewSet
):
    """DiLoCo jobs. You see and cancel your own jobs; staff see and cancel every job."""

    serializer_class = JobSerializer
    parser_classes = [BoundedJSONParser]

    def get_queryset(self) -> QuerySet[Job]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular inspecting the view
            return Job.objects.none()
        jobs = Job.objects.select_related("owner").prefetch_related(
            Prefetch("leases", queryset=Lease.objects.select_related("worker").order_by("created_at"))
        )
        if self.action != "list":
            jobs = jobs.prefetch_related(
                "events", "rounds", Prefetch("tasks", queryset=Task.objects.select_related("lease__worker"))
            )
        if not self.request.user.is_staff:
            jobs = jobs.filter(owner=self.request.user)
        if self.action == "list":
            jobs = self._filtered(jobs)
        return jobs

    def _filtered(self, jobs: QuerySet[Job]) -> QuerySet[Job]:
        """The list's ``status`` (one of the statuses, else a 400) and ``name`` (text in the name) filters."""
        params = self.request.query_params
        wanted = params.get("status")
        if wanted is not None:
            if wanted not in Job.Status.values:
                raise ValidationError({"status": [f"One of {', '.join(Job.Status.values)}."]})
            jobs = jobs.filter(status=wanted)
        text = params.get("name")
        if text:
            if len(text) > 200:
                raise ValidationError({"name": ["At most 200 characters."]})
            if problem := hostile_string_problem(text):  # PostgreSQL refuses NUL in a query
                raise ValidationError({"name": [problem]})
            jobs = jobs.filter(name__icontains=text)
        return jobs

    def get_serializer_class(self):
        if self.action == "create":
            return JobCreateSerializer
        if self.action == "list":
            return JobSerializer
        return JobDetailSerializer

    def create(self, request: Request, *args, **kwargs) -> Response:
        submission = JobCreateSerializer(data=request.data, context={"request": request})
        submission.is_valid(raise_exception=True)
        job = services.create_job(owner=request.user, **submission.service_arguments())
        return _submitted(self.get_queryset(), job)

    @extend_schema(
        summary="Submit a DiLoCo training job from its full specification",
        description=(
            "The body is a DiLoCo specification as JSON (model, dataset, inner and outer optimizer, rounds, "
            "batch size, trainers, and per role resources and prices; an optional `name`), or Hypha's scheduler "
            "TOML (`Content-Type: application/toml`, the `[scheduler.job]` table with the keys the original "
            "reads, and the spellings its docs used; the name then comes from `?name=`). Every mistake is "
            "reported at once, keyed by its dotted field path. The roles are advertised as for `POST /api/jobs/`; "
            "once all are leased the parameter server and then the trainers are dispatched (docs/training.md). "
            "The dataset must already be registered by a data node."
        ),
        parameters=[OpenApiParameter("name", OpenApiTypes.STR, description="job name, for a TOML body")],
        request={"application/json": DiLoCoSubmission, "application/toml": OpenApiTypes.STR},
        responses={201: JobSubmittedSerializer, **error_responses(400, 401, 413, 415)},
        examples=[OpenApiExample("a small causal LM", value=DILOCO_EXAMPLE, request_only=True)],
    )
    @action(detail=False, methods=["post"], url_path="diloco", parser_classes=[BoundedJSONParser, TomlParser])
    def diloco(self, request: Request) -> Response:
        body = request.data
        try:
            if isinstance(body, str):
                name = request.query_params.get("name", "")
                if problem := hostile_string_problem(name):
                    return Response({"name": [problem]}, status=status.HTTP_400_BAD_REQUEST)
                parsed = spec.parse_toml(body)
            else:
                body = dict(body) if isinstance(body, dict) else body
                name = body.pop("name", "") if isinstance(body, dict) else ""
                parsed = spec.parse_json(body)
        except SpecUnreadable as error:
            # A document that cannot be read at all is answered as malformed JSON is: ``{"detail": ...}``.
            raise ParseError(error.message) from None
        except SpecError as error:
            return Response(spec_error_body(error), status=status.HTTP_400_BAD_REQUEST)
        problems = services.training_problems(parsed, request.user)
        if problems:
            return Response(problems, status=status.HTTP_400_BAD_REQUEST)
        if not isinstance(name, str) or len(name) > 200:
            return Response(
                {"name": ["A string of at most 200 characters."]}, status=status.HTTP_400_BAD_REQUEST
            )
        job = services.create_job(
            owner=request.user,
            name=name,
            num_trainers=parsed.num_trainers,
            requirements=spec.to_requirements(parsed),
            spec=services.spec_for_storage(parsed, request.user),
            allocation_timeout=parsed.allocation_timeout,
        )
        return _submitted(self.get_queryset(), job)

    @extend_schema(
        summary="A job's per-step training metrics, for charts",
        description=(
            "Each trainer's per-step series (loss mean/min/max, learning rate, samples/s and tokens/s of step "
            "time, by step and time; at most `HYPHA_METRICS_MAX_POINTS` points each, neighbours merged as a "
            "long job grows), the trainers' mean loss per step bucket, and each round's mean and eval loss and "
            "bytes. Missing values are null. `trainer` (a task id or worker id) keeps one trainer; "
            "`max_points` merges each series pairwise down to at most that many points (docs/dashboard.md)."
        ),
        parameters=[
            OpenApiParameter("trainer", OpenApiTypes.STR, description="a trainer's task id or worker id"),
            OpenApiParameter(
                "max_points", OpenApiTypes.INT, description="at most this many points per series (10–10000)"
            ),
        ],
        responses={200: JobMetricsSerializer, **error_responses(400, 401, 404)},
    )
    @action(detail=True, methods=["get"])
    def metrics(self, request: Request, pk: str | None = None) -> Response:
        job = self.get_object()
        trainer = request.query_params.get("trainer") or None
        if trainer is not None and len(trainer) > 64:
            return Response({"trainer": ["At most 64 characters."]}, status=status.HTTP_400_BAD_REQUEST)
        max_points = request.query_params.get("max_points")
        if max_points is not None:
            if not max_points.isdigit() or not 10 <= int(max_points) <= 10_000:
                return Response(
                    {"max_points": ["A whole number from 10 to 10000."]}, status=status.HTTP_400_BAD_REQUEST
                )
            max_points = int(max_points)
        return Response(metrics.job_metrics(job, trainer=trainer, max_points=max_points))

    @extend_schema(
        summary="Cancel a job",
        description="Closes the job's advertisements and releases every lease it holds.",
        request=None,
        responses={200: JobDetailSerializer, **error_responses(401, 404, 409)},
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        job = self.get_object()
        reason = (
            "cancelled by its owner" if job.owner_id == request.user.pk else f"cancelled by {request.user}"
        )
        try:
            services.cancel_job(job, reason=reason)
        except JobNotCancellable as error:
            return Response({"detail": str(error)}, status=status.HTTP_409_CONFLICT)
        return Response(JobDetailSerializer(self.get_queryset().get(pk=job.pk)).data)

    @extend_schema(
        summary="Discard a job's last closed round",
        description=(
            "The job's owner (or staff) discards round `number`, the running job's last closed round: the next "
            "round closes by going back to the weights and outer momentum of round `number` − 1, its updates "
            'dropped, and every trainer continues from there (docs/training.md, "Discarding a round"). The '
            "round's `discard_requested_at` records the request; the next round's `discarded` says whether it "
            "was taken (the parameter server hears it when that round asks whom to wait for: a round that "
            "closes before it asks again lets the request lapse). 404: no such closed round. 409, with the "
            "reason: the job is not running, the round is not its last closed one, is its last round, was "
            "discarded or asked to be already, or the job overlaps rounds or sends a lossy encoding."
        ),
        request=None,
        parameters=[OpenApiParameter("number", OpenApiTypes.INT, OpenApiParameter.PATH, description="round")],
        responses={200: JobDetailSerializer, **error_responses(401, 404, 409)},
    )
    @action(detail=True, methods=["post"], url_path=r"rounds/(?P<number>[0-9]{1,9})/discard")
    def discard(self, request: Request, pk: str | None = None, number: str = "") -> Response:
        job = self.get_object()
        by = "its owner" if job.owner_id == request.user.pk else str(request.user)
        try:
            request_discard(job, int(number), by=by)
        except Round.DoesNotExist:
            raise NotFound(f"job {job.pk} has no closed round {number}") from None
        except RoundNotDiscardable as error:
            return Response({"detail": str(error)}, status=status.HTTP_409_CONFLICT)
        return Response(JobDetailSerializer(self.get_queryset().get(pk=job.pk)).data)


def _submitted(jobs: QuerySet[Job], job: Job) -> Response:
    """The 201 of a submission: the job, re-read (outside a server the allocation ran right after the commit
    and changed it), with the warnings of the fleet check made when it was created."""
    context = {"warnings": job.submission_warnings}
    return Response(
        JobSubmittedSerializer(jobs.get(pk=job.pk), context=context).data, status=status.HTTP_201_CREATED
    )


class JobModelView(APIView):
    """The final model of a job: the parameter server uploads it (transfer token), users download it."""

    authentication_classes: list = []
    permission_classes: list = []

    @extend_schema(
        summary="Upload a file of a job's final model (the job's parameter server only)",
        description=(
            "Called by the job's parameter server after its last round, with its transfer token "
            "(`Authorization: Bearer <token>`, signed by the control plane for that job). The body is the file. "
            "Only the model's files are taken (`config.json`, `model.safetensors`, and the data files the "
            "initial model had: `generation_config.json`, tokenizer files, …; the enum): any other name is a "
            "400. The weights come last: the model counts as stored once they are."
        ),
        parameters=[
            OpenApiParameter(
                "filename",
                OpenApiTypes.STR,
                OpenApiParameter.PATH,
                enum=list(training.FINAL_MODEL_FILES),
                description="the file name: one of the model's files",
            )
        ],
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={
            201: OpenApiResponse(description="stored: `{name, size, sha256}`"),
            **error_responses(400, 401, 403, 404, 409, 413),
        },
    )
    def put(self, request: Request, pk: str, filename: str) -> Response:
        return _stored_file(
            pk,
            filename,
            lambda job: services.model_uploaded(
                job=job,
                filename=filename,
                token=_bearer(request),
                chunks=request_chunks(request),
                limit=settings.HYPHA_MAX_MODEL_FILE_BYTES,
            ),
        )


class JobCheckpointUploadView(APIView):
    """A file of a round's checkpoint: the job's parameter server saves each round with the control plane."""

    authentication_classes: list = []
    permission_classes: list = []

    @extend_schema(
        summary="Save a file of a round's checkpoint (the job's parameter server only)",
        description=(
            "Called by the job's live parameter server after each round (and for round 0), with its transfer "
            "token. The files of the round come first, its manifest `round.json` last: the round then "
            "replaces the job's saved checkpoint, which a parameter server started after this one was lost "
            "resumes from. The copy is incremental: `weights.safetensors` only at a base round (the "
            "manifest's `base_round` is the round itself; every `rounds.checkpoint_every` rounds), "
            "`momentum.safetensors` and `result.safetensors` every round; a round on an earlier base must "
            "follow the saved round on the same base (409 otherwise). A round older than the saved one is "
            "refused (409); the saved one again is a no-op."
        ),
        parameters=[
            OpenApiParameter(
                "round_number",
                OpenApiTypes.INT,
                OpenApiParameter.PATH,
                description="the round (0: the initial model)",
            ),
            OpenApiParameter(
                "filename",
                OpenApiTypes.STR,
                OpenApiParameter.PATH,
                enum=list(training.CHECKPOINT_FILES),
                description="the file",
            ),
        ],
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={
            201: OpenApiResponse(description="stored: `{name, size, sha256}`"),
            **error_responses(400, 401, 403, 404, 409, 413),
        },
    )
    def put(self, request: Request, pk: str, round_number: int, filename: str) -> Response:
        return _stored_file(
            pk,
            filename,
            lambda job: services.checkpoint_uploaded(
                job=job,
                round_number=round_number,
                filename=filename,
                token=_bearer(request),
                chunks=request_chunks(request),
                limit=settings.HYPHA_MAX_MODEL_FILE_BYTES,
            ),
        )


class JobCheckpointDownloadView(APIView):
    """A file of the job's saved round, for a parameter server that resumes from it."""

    authentication_classes: list = []
    permission_classes: list = []

    @extend_schema(
        summary="Fetch a file of the job's saved round (the job's parameter server only)",
        description=(
            "The files the job's `checkpoint` names: the saved round's `round.json` and "
            "`momentum.safetensors`, its base round's `weights.safetensors` and `result-<n>.safetensors` "
            "for each round n after the base up to the saved one, which a resuming server replays on the "
            'base weights (docs/training.md, "A parameter server lost").'
        ),
        parameters=[
            OpenApiParameter(
                "filename",
                OpenApiTypes.STR,
                OpenApiParameter.PATH,
                pattern=r"^(round\.json|weights\.safetensors|momentum\.safetensors|result(-[0-9]{1,9})?\.safetensors)$",
                description="a file the job's checkpoint names",
            )
        ],
        responses={
            (200, "application/octet-stream"): OpenApiTypes.BINARY,
            **error_responses(401, 403, 404, 409),
        },
    )
    def get(self, request: Request, pk: str, filename: str):
        job = Job.objects.filter(pk=pk).first()
        if job is None:
            return Response({"detail": "No such job."}, status=status.HTTP_404_NOT_FOUND)
        try:
            path = training.checkpoint_file(job, filename, _bearer(request))
        except TransferRefused as refused:
            return Response({"detail": str(refused)}, status=refused.status)
        return file_response(request, path)


@extend_schema(
    summary="Download a job's final model",
    description="A zip of the model files once the job has completed: `config.json`, `model.safetensors`, and "
    "the data files the initial model had (`generation_config.json`, tokenizer files, …; not code).",
    responses={
        (200, "application/zip"): OpenApiTypes.BINARY,
        **error_responses(401, 404, 409),
    },
)
@api_view(["GET"])
def job_model_download(request: Request, pk: str):
    jobs = Job.objects.all() if request.user.is_staff else Job.objects.filter(owner=request.user)
    job = jobs.filter(pk=pk).first()
    if job is None:
        return Response({"detail": "No such job."}, status=status.HTTP_404_NOT_FOUND)
    archive = training.model_archive(job)
    if archive is None:
        return Response(
            {"detail": f"job {job.pk} has no model yet (it is {job.status})"}, status=status.HTTP_409_CONFLICT
        )
    return file_response(request, archive, content_type="application/zip", filename=f"model-{job.pk}.zip")


class PlainTextRenderer(BaseRenderer):
    """``text/plain`` for a client that asks for it (a task's log); an error body becomes its ``detail``."""

    media_type = "text/plain"
    format = "txt"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None) -> bytes:
        if isinstance(data, dict) and "detail" in data:
            data = data["detail"]
        return str(data).encode(self.charset)


@extend_schema(
    summary="Download a task's log",
    description="The task's full output as its daemon forwarded it, while it runs and after it ended. Kept "
    "up to `HYPHA_TASK_LOG_MAX_BYTES` (4 MiB by default): past that its oldest output is dropped and the "
    "first line says how many bytes were; empty while the task has printed nothing. Deleted "
    "`HYPHA_TASK_LOG_RETENTION_DAYS` (30 by default) after the job ended: then one line says so. 404 for a "
    "job that is not yours or a task not of that job.",
    parameters=[OpenApiParameter("format", exclude=True)],
    responses={
        (200, "text/plain"): OpenApiTypes.STR,
        **error_responses(401, 404),
    },
)
@api_view(["GET"])
@renderer_classes([JSONRenderer, PlainTextRenderer])
def job_task_log(request: Request, pk: str, task_id: str):
    jobs = Job.objects.all() if request.user.is_staff else Job.objects.filter(owner=request.user)
    task = Task.objects.filter(pk=task_id, job__in=jobs.filter(pk=pk)).first()
    if task is None:
        return Response({"detail": "No such task."}, status=status.HTTP_404_NOT_FOUND)
    text = training.task_logs.read(task.job_id, task.pk)
    if text is None:
        text = training.task_logs.deleted_note(task.job.ended_at) or ""
    response = HttpResponse(text.encode("utf-8"), content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'inline; filename="task-{task.pk}.log"'
    response["X-Content-Type-Options"] = "nosniff"
    return response


def _stored_file(pk: str, filename: str, store) -> Response:
    """Store a file a job's parameter server uploads with ``store(job)`` (its ``{size, sha256}``): 201, or
    the refusal as an API error."""
    job = Job.objects.filter(pk=pk).first()
    if job is None:
        return Response({"detail": "No such job."}, status=status.HTTP_404_NOT_FOUND)
    try:
        entry = store(job)
    except TransferRefused as refused:
        return _refused(refused, field="filename")
    return Response({"name": filename, **entry}, status=status.HTTP_201_CREATED)


def _refused(refused: TransferRefused, *, field: str) -> Response:
    """A refused transfer as an API error: a 400 (a bad file name) names ``field``, like every 400; the
    others are ``{"detail": ...}``."""
    if refused.status == status.HTTP_400_BAD_REQUEST:
        return Response({field: [str(refused)]}, status=refused.status)
    return Response({"detail": str(refused)}, status=refused.status)


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _declared_size(request: Request) -> int | None:
    try:
        return int(request.headers["Content-Length"])
    except (KeyError, ValueError):
        return None


@extend_schema_view(
    list=extend_schema(
        summary="List your uploads", responses={200: UploadSerializer, **error_responses(401)}
    ),
    retrieve=extend_schema(
        summary="Show an upload", responses={200: UploadSerializer, **error_responses(401, 404)}
    ),
)
class UploadViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Files uploaded to the control plane: a model to train (a zip or tar of a transformers model directory with
    `config.json` and its weights) that a DiLoCo spec names with `{"type": "upload", "file": <id or name>}`.
    Each user's uploads are bounded (`HYPHA_UPLOAD_QUOTA_BYTES`, `HYPHA_UPLOAD_QUOTA_COUNT`); deleting one
    frees its room."""

    serializer_class = UploadSerializer

    def get_queryset(self) -> QuerySet[Upload]:
        if getattr(self, "swagger_fake_view", False):
            return Upload.objects.none()
        uploads = Upload.objects.all()
        return uploads if self.request.user.is_staff else uploads.filter(owner=self.request.user)

    @extend_schema(
        summary="Upload a file",
        description="The request body is the file itself (`Content-Type: application/octet-stream`); `?name=` "
        "names it (letters, digits, `.`, `_`, `-`).",
        parameters=[
            OpenApiParameter(
                "name",
                OpenApiTypes.STR,
                required=True,
                pattern=training.MODEL_FILENAME.pattern,
                description="the file name",
            )
        ],
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={201: UploadSerializer, **error_responses(400, 401, 413)},
    )
    def create(self, request: Request) -> Response:
        try:
            upload = training.store_upload(
                request.user,
                request.query_params.get("name", ""),
                request_chunks(request),
                limit=settings.HYPHA_MAX_UPLOAD_BYTES,
                declared_size=_declared_size(request),
            )
        except TransferRefused as refused:
            return _refused(refused, field="name")
        return Response(UploadSerializer(upload).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="Delete an upload",
        description="Its owner (or staff) deletes it and its file, freeing room in their quota; refused (409) "
        "while a job that has not ended is built from it.",
        responses={204: None, **error_responses(401, 404, 409)},
    )
    def destroy(self, request: Request, pk: str | None = None) -> Response:
        try:
            delete_upload(str(pk), user=request.user)
        except TransferRefused as refused:
            return Response({"detail": str(refused)}, status=refused.status)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        summary="Download an upload's content",
        description="Its owner, or the parameter server of a job built from it (with its transfer token).",
        responses={(200, "application/octet-stream"): OpenApiTypes.BINARY, **error_responses(401, 403, 404)},
    )
    @action(detail=True, methods=["get"], permission_classes=[], authentication_classes=[])
    def content(self, request: Request, pk: str | None = None):
        try:
            upload = Upload.objects.filter(pk=uuid.UUID(str(pk))).first()
        except ValueError:  # the route takes any segment; a malformed id names no upload
            upload = None
        if upload is None:
            return Response({"detail": "No such upload."}, status=status.HTTP_404_NOT_FOUND)
        user = None
        if _bearer(request) is None:
            from rest_framework.authentication import SessionAuthentication

            from hypha_site.api import UserTokenAuthentication

            for authenticator in (UserTokenAuthentication(), SessionAuthentication()):
                try:
                    found = authenticator.authenticate(request)
                except Exception:  # a bad token is simply not this user
                    found = None
                if found is not None:
                    user = found[0]
                    break
        try:
            training.authorise_upload_download(upload, user=user, token=_bearer(request))
        except TransferRefused as refused:
            return Response({"detail": str(refused)}, status=refused.status)
        # Opaque bytes whatever the name: a content type guessed from it (application/zip, x-tar...) would
        # promise a format nobody checked.
        return file_response(request, upload.path, filename=upload.name)
