"""The inference jobs API (docs/inference.md): submit a batch inference job, its workers upload one result per
slice, its owner downloads them (one at a time, or every one as a zip)."""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, extend_schema
from pydantic import Field
from rest_framework import status
from rest_framework.decorators import api_view
from rest_framework.exceptions import ParseError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.jobs import inference, services
from apps.jobs.api.serializers import JobSubmittedSerializer
from apps.jobs.api.views import TomlParser, _bearer, _declared_size, _refused, _submitted, spec_error_body
from apps.jobs.exceptions import SpecError, SpecUnreadable, TransferRefused
from apps.jobs.inference import submission
from apps.jobs.models import Job
from apps.jobs.spec import inference as inference_spec
from apps.jobs.spec_toml import parse_inference_toml
from hypha_site.api import error_responses
from hypha_site.parsers import BoundedJSONParser
from hypha_site.streaming import file_response, request_chunks
from worker_daemon.bounded_json import hostile_string_problem

NAME_MAX_LENGTH = 200
#: The route takes any digits; a slice index beyond the database's integers names no slice.
MAX_INDEX = 2**31 - 1


class InferenceSubmission(inference_spec.InferenceSpec):
    """A batch inference job: the model, the dataset whose slices are the units of work, the task, the
    workers and what each needs and is paid; and a name for you."""

    name: str = Field(default="", max_length=NAME_MAX_LENGTH, description="a label for you")


INFERENCE_EXAMPLE = {
    "name": "embed-corpus",
    "model": {
        "source": {
            "type": "huggingface",
            "repository": "sentence-transformers/all-MiniLM-L6-v2",
            "filenames": ["config.json", "model.safetensors"],
        }
    },
    "dataset": {"name": "corpus"},
    "task": {"type": "embed"},
    "batch_size": 32,
    "workers": 4,
    "worker": {"resources": {"cpu": 2, "memory": 8}, "price": {"bid": 50, "max": 80}},
}


class InferenceJobView(APIView):
    """Submit a batch inference job."""

    parser_classes = [BoundedJSONParser, TomlParser]

    @extend_schema(
        operation_id="jobs_inference_create",
        summary="Submit a batch inference job",
        description=(
            "The body is an inference specification (docs/inference.md): the model (the sources of a DiLoCo "
            "spec: `huggingface`, `url`, `upload`, `config`), a registered dataset, the task (`generate`, "
            "`classify` or `embed`), `batch_size`, `workers` (1–64), the `worker` role's resources and price, "
            "and an optional `name`. Every mistake is reported at once, keyed by its dotted field path. The job "
            "gets one slice per slice of the dataset; its `workers` are advertised as role `inference` "
            "(executor class `inference`) and dispatched once leased. Each slice's result is uploaded to "
            "`PUT /api/jobs/{id}/results/{index}/`; the job completes when every slice has its result. "
            "The body may also be the job's TOML (`Content-Type: application/toml`: the job table with "
            '`type = "inference"`, docs/inference.md; the name then comes from `?name=`).'
        ),
        parameters=[OpenApiParameter("name", OpenApiTypes.STR, description="job name, for a TOML body")],
        request={"application/json": InferenceSubmission, "application/toml": OpenApiTypes.STR},
        responses={201: JobSubmittedSerializer, **error_responses(400, 401, 413, 415)},
        examples=[OpenApiExample("embed a corpus", value=INFERENCE_EXAMPLE, request_only=True)],
    )
    def post(self, request: Request) -> Response:
        body = request.data
        if isinstance(body, dict):
            body = dict(body)
            name = body.pop("name", "")
        elif isinstance(body, str):
            name = request.query_params.get("name", "")
            if problem := hostile_string_problem(name):
                return Response({"name": [problem]}, status=status.HTTP_400_BAD_REQUEST)
        else:
            name = ""
        try:
            parsed = parse_inference_toml(body) if isinstance(body, str) else inference_spec.parse_json(body)
        except SpecUnreadable as error:
            # A TOML that cannot be read at all is answered as malformed JSON is: ``{"detail": ...}``.
            raise ParseError(error.message) from None
        except SpecError as error:
            return Response(spec_error_body(error), status=status.HTTP_400_BAD_REQUEST)
        if not isinstance(name, str) or len(name) > NAME_MAX_LENGTH:
            return Response(
                {"name": ["A string of at most 200 characters."]}, status=status.HTTP_400_BAD_REQUEST
            )
        problems = submission.problems(parsed, request.user)
        if problems:
            return Response(problems, status=status.HTTP_400_BAD_REQUEST)
        job = submission.submit(owner=request.user, name=name, parsed=parsed)
        return _submitted(Job.objects.select_related("owner"), job)


def _visible_job(request: Request, pk) -> Job | None:
    jobs = Job.objects.all() if request.user.is_staff else Job.objects.filter(owner=request.user)
    return jobs.filter(pk=pk).first()


def _authenticated_user(request: Request):
    """The user of a ``Token`` header or a session, else ``None`` (the view takes transfer tokens too)."""
    from django.contrib.auth import get_user
    from rest_framework.exceptions import APIException

    from hypha_site.api import UserTokenAuthentication

    try:
        found = UserTokenAuthentication().authenticate(request)
    except APIException:  # a bad token is simply no user
        found = None
    if found is not None:
        return found[0]
    # The session's user, read from the session itself: with no authenticators on the view, DRF has set the
    # request's user to anonymous already (the dashboard's per-slice links take the session).
    user = get_user(request._request)
    return user if user.is_authenticated and user.is_active else None


INDEX_PARAMETER = OpenApiParameter(
    "index", OpenApiTypes.INT, OpenApiParameter.PATH, description="the slice's index in the dataset"
)
RESULT_ENTRY = OpenApiResponse(
    description="`{index, sha256, size, status}` of the stored result; `status` is `accepted`, or for a "
    "verified slice `pending` (another worker computes it too), `disputed` or `rejected`"
)


class JobResultView(APIView):
    """One slice's result: the job's inference worker uploads it (transfer token), the owner downloads it."""

    authentication_classes: list = []
    permission_classes: list = []

    @extend_schema(
        operation_id="jobs_result_update",
        summary="Upload the result of one slice (the job's inference workers only)",
        description=(
            "Called by an inference worker of the job with its task's transfer token (`Authorization: Bearer "
            "<token>`), for a slice assigned to it. The body is the result file; `X-Content-SHA256` its SHA-256 "
            "(hex; a body that differs is a 400) and `X-Result-Format` `safetensors` or `jsonl`. At most "
            "`HYPHA_MAX_RESULT_BYTES` (413 above). Stored, the slice is USED (201) — for a slice the spec's "
            "`verification` picks, once two workers' results agree; the same result sent again "
            "by the same worker is a 200 and changes nothing; a slice not assigned to the sender is a 409. The "
            "job completes with its last slice's result."
        ),
        parameters=[
            INDEX_PARAMETER,
            OpenApiParameter("X-Content-SHA256", OpenApiTypes.STR, OpenApiParameter.HEADER, required=True),
            OpenApiParameter(
                "X-Result-Format",
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,
                required=True,
                enum=list(inference.results.FORMATS),
            ),
        ],
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={200: RESULT_ENTRY, 201: RESULT_ENTRY, **error_responses(400, 401, 403, 404, 409, 413)},
    )
    def put(self, request: Request, pk, index: int) -> Response:
        job = Job.objects.filter(pk=pk).first()
        if job is None:
            return Response({"detail": "No such job."}, status=status.HTTP_404_NOT_FOUND)
        if index > MAX_INDEX:
            return Response(
                {"detail": f"job {job.pk} has no slice {index}"}, status=status.HTTP_404_NOT_FOUND
            )
        try:
            entry, created = services.result_uploaded(
                job=job,
                index=index,
                headers={
                    "sha256": request.headers.get("X-Content-SHA256"),
                    "result_format": request.headers.get("X-Result-Format"),
                    "declared_size": _declared_size(request),
                },
                token=_bearer(request),
                chunks=request_chunks(request),
                limit=settings.HYPHA_MAX_RESULT_BYTES,
            )
        except TransferRefused as refused:
            return _refused(refused, field="result")
        return Response(entry, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(
        operation_id="jobs_result_retrieve",
        summary="Download the result of one slice",
        description="The job's owner (or staff) downloads the accepted result of slice `index` "
        "(`<index>.safetensors` or `<index>.jsonl`); 404 while it has none.",
        parameters=[INDEX_PARAMETER],
        responses={(200, "application/octet-stream"): OpenApiTypes.BINARY, **error_responses(401, 404)},
    )
    def get(self, request: Request, pk, index: int):
        request.user = _authenticated_user(request)
        if request.user is None:
            return Response(
                {"detail": "Authentication credentials were not provided."},
                status=status.HTTP_401_UNAUTHORIZED,
            )
        job = _visible_job(request, pk)
        found = inference.result_file(job, index) if job is not None and index <= MAX_INDEX else None
        if found is None:
            return Response({"detail": "No such result."}, status=status.HTTP_404_NOT_FOUND)
        path, name = found
        return file_response(request, path, filename=name)


@extend_schema(
    operation_id="jobs_results_archive",
    summary="Download every result of an inference job",
    description="A zip of the job's accepted results (one per slice), `<index>.safetensors` or "
    "`<index>.jsonl` each, and `manifest.json` (`{job, slices_done, slices_total, results: [{index, file, format, sha256, size, "
    "worker}]}`); while the job runs, those stored so far. 409 for a training job.",
    responses={(200, "application/zip"): OpenApiTypes.BINARY, **error_responses(401, 404, 409)},
)
@api_view(["GET"])
def job_results_download(request: Request, pk):
    job = _visible_job(request, pk)
    if job is None:
        return Response({"detail": "No such job."}, status=status.HTTP_404_NOT_FOUND)
    if not inference.is_inference_job(job):
        return Response({"detail": f"job {job.pk} is not an inference job"}, status=status.HTTP_409_CONFLICT)
    archive = inference.archive(job)
    return file_response(request, archive, content_type="application/zip", filename=f"results-{job.pk}.zip")


__all__ = ["InferenceJobView", "JobResultView", "job_results_download"]
