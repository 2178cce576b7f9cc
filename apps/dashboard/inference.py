"""The dashboard's side of batch inference jobs (docs/inference.md): the job page's progress over slices, its
workers and stored results, and the submission form next to the DiLoCo one.

The progress has the keys of a training job's (``apps.dashboard.progress``: ``fraction``, ``percent``,
``elapsed``, ``eta``, ``text``…) so the page's bar and its script draw both kinds alike; the work counted is
slices with a stored result (USED), since a slice is done exactly when its result is stored.
"""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import datetime, timedelta

from django import forms
from django.db.models import Min
from django.urls import reverse
from django.utils import timezone

from apps.jobs.exceptions import SpecError
from apps.jobs.inference.dispatch import progress as job_progress
from apps.jobs.models import INFERENCE, InferenceResult, Job, Task
from apps.jobs.spec import inference as inference_spec

#: How many of the newest stored results the job page lists with their own link (the zip has every one).
RECENT_RESULTS = 25


def is_inference(job: Job) -> bool:
    return job.kind == Job.Kind.INFERENCE


def task_type(job: Job) -> str | None:
    task = job.spec.get("task") if isinstance(job.spec, dict) else None
    return task.get("type") if isinstance(task, dict) else None


def inference_progress(job: Job, *, now: datetime | None = None) -> dict:
    """Slices done of all, samples/s (the rows the workers reported over the time since the first dispatch)
    and a straight-line ETA over the slices left, while RUNNING."""
    from apps.dashboard.progress import format_seconds, summary

    now = now or timezone.now()
    # The API's progress (slices done of all, and the verification's counts where the job has them).
    counts = job_progress(job)
    done, total = counts["slices_done"], counts["slices_total"]
    tasks = Task.objects.filter(job=job, role=INFERENCE)
    started_at = tasks.aggregate(first=Min("dispatched_at"))["first"]
    samples = sum(tasks.values_list("samples_total", flat=True))
    until = job.ended_at if job.is_final and job.ended_at else now
    elapsed = max(0.0, (until - started_at).total_seconds()) if started_at else None
    fraction = 1.0 if job.status == Job.Status.COMPLETED else (done / total if total else None)
    eta = eta_at = None
    if job.status == Job.Status.RUNNING and elapsed and 0 < done < total:
        eta = elapsed * (total - done) / done
        eta_at = now + timedelta(seconds=eta)
    ended_at = job.ended_at if job.is_final else None
    rate = round(samples / elapsed, 2) if elapsed and samples else None
    progress = {
        **counts,
        "kind": Job.Kind.INFERENCE,
        "samples": samples,
        "samples_per_second": rate,
        # The training keys the shared summary and script read; no rounds or steps here.
        "rounds_done": 0,
        "rounds_total": None,
        "steps_done": None,
        "steps_total": None,
        "fraction": None if fraction is None else round(fraction, 4),
        "percent": None if fraction is None else int(fraction * 100),
        "started_at": started_at,
        "elapsed": None if elapsed is None else round(elapsed, 1),
        "eta": None if eta is None else round(eta, 1),
        "eta_at": eta_at,
        "ended_at": ended_at,
        "duration": round((ended_at - job.created_at).total_seconds(), 1) if ended_at else None,
        "final": job.is_final,
        "status": job.status,
    }
    parts = [f"slice {done} of {total} done"] if total else []
    parts += [f"{counts[key]} {key}" for key in ("verified", "disputed", "rejected") if counts.get(key)]
    if rate is not None:
        parts.append(f"{rate:g} samples/s")
    # The shared line says the percentage, elapsed/ETA or the end; its "trained" reads "ran" here.
    line = summary(progress).replace("trained ", "ran ")
    progress["text"] = " · ".join(parts + ([line] if line else []))
    progress["elapsed_text"] = None if elapsed is None else format_seconds(elapsed)
    return progress


def _task_rate(task: Task, now: datetime) -> float | None:
    if task.dispatched_at is None or not task.samples_total:
        return None
    seconds = ((task.ended_at or now) - task.dispatched_at).total_seconds()
    return round(task.samples_total / seconds, 2) if seconds > 0 else None


def section(job: Job) -> dict | None:
    """The job page's inference card: the task, each worker's counts and the newest stored results with their
    download links; ``None`` for a training job (the page and its events leave it out)."""
    if not is_inference(job):
        return None
    now = timezone.now()
    stored = defaultdict(int)
    for lease_id in InferenceResult.objects.filter(job=job).values_list("lease_id", flat=True):
        stored[lease_id] += 1
    tasks = (
        Task.objects.filter(job=job, role=INFERENCE).select_related("lease__worker").order_by("dispatched_at")
    )
    workers = [
        {
            "id": str(task.pk),
            "worker": task.lease.worker.name,
            "worker_id": str(task.lease.worker_id),
            "status": task.status,
            "results": stored.get(task.lease_id, 0),
            "samples_total": task.samples_total,
            "samples_per_second": _task_rate(task, now),
        }
        for task in tasks
    ]
    newest = (
        InferenceResult.objects.filter(job=job).select_related("worker").order_by("-created_at", "-index")
    )
    results = [
        {
            "index": result.index,
            "format": result.format,
            # accepted, or pending/disputed/rejected while a verified slice is compared (docs/inference.md)
            "status": getattr(result, "status", "accepted"),
            "size": result.size,
            "sha256": result.sha256,
            "worker": result.worker.name if result.worker else None,
            "created_at": result.created_at,
            "url": reverse("job-result", kwargs={"pk": job.pk, "index": result.index}),
        }
        for result in newest[:RECENT_RESULTS]
    ]
    return {
        "task": task_type(job),
        "task_settings": job.spec.get("task") if isinstance(job.spec, dict) else None,
        "dataset": (job.spec.get("dataset") or {}).get("name") if isinstance(job.spec, dict) else None,
        "workers": workers,
        "results": results,
        "results_stored": sum(stored.values()),
        "archive_url": reverse("job-results", kwargs={"pk": job.pk}),
    }


# --- the submission form ----------------------------------------------------------------------------------

#: Spec paths (their longest matching prefix) → the field an error is shown next to.
FIELD_OF_PATH = {
    "model": "source_type",
    "model.source": "source_type",
    "model.source.repository": "repository",
    "model.source.revision": "revision",
    "model.source.filenames": "filenames",
    "model.source.url": "url",
    "model.source.file": "upload",
    "model.source.config": "model_config",
    "model.input_names": "input_names",
    "dataset": "dataset",
    "task": "task",
    "task.max_new_tokens": "max_new_tokens",
    "task.temperature": "temperature",
    "task.seed": "seed",
    "task.top_k": "top_k",
    "batch_size": "batch_size",
    "workers": "workers",
    "allocation_timeout": "allocation_timeout",
    **{f"worker.resources.{key}": key for key in ("cpu", "memory", "storage", "gpu")},
    "worker.price.bid": "bid",
    "worker.price.max": "max_price",
    "worker.price": "bid",
}

SOURCES = [
    ("huggingface", "Hugging Face repository"),
    ("url", "URL of a model archive"),
    ("upload", "an upload of yours (POST /api/uploads/)"),
    ("config", "a transformers config (random weights)"),
]


def _number(label: str, initial, help_text: str = "", *, integer: bool = False, required: bool = True):
    field_class = forms.IntegerField if integer else forms.FloatField
    widget = forms.NumberInput(attrs={"step": "1" if integer else "any"})
    return field_class(label=label, initial=initial, help_text=help_text, required=required, widget=widget)


class InferenceJobForm(forms.Form):
    """``POST /api/jobs/inference/``'s body as fields, checked by :func:`apps.jobs.spec.inference.parse_json`
    and :func:`apps.jobs.inference.submission.problems`, exactly as the API checks it."""

    name = forms.CharField(
        label="Name", max_length=200, required=False, help_text="a label for you (optional)"
    )
    source_type = forms.ChoiceField(label="Model source", choices=SOURCES, initial="huggingface")
    repository = forms.CharField(label="Repository", required=False, help_text="huggingface: owner/name")
    revision = forms.CharField(label="Revision", required=False, help_text="huggingface (empty: main)")
    filenames = forms.CharField(
        label="Files",
        required=False,
        help_text="huggingface: comma-separated, e.g. config.json, model.safetensors",
    )
    url = forms.CharField(label="URL", required=False, help_text="url: http(s) address of the model")
    upload = forms.CharField(label="Upload", required=False, help_text="upload: its file name or id")
    model_config = forms.CharField(
        label="Model config (JSON)",
        required=False,
        widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false", "class": "code"}),
        help_text="config: a transformers config.json",
    )
    input_names = forms.CharField(
        label="Input names", initial="input_ids", help_text="slice tensors the model takes, comma-separated"
    )
    dataset = forms.ChoiceField(label="Dataset", choices=(), help_text="its slices are the units of work")
    task = forms.ChoiceField(
        label="Task",
        choices=[
            ("generate", "generate (causal LM)"),
            ("classify", "classify (logits or top-k)"),
            ("embed", "embed (mean-pooled hidden states)"),
        ],
        initial="generate",
    )
    max_new_tokens = _number("Max new tokens", 16, "generate: 1–1024", integer=True, required=False)
    temperature = _number("Temperature", 0.0, "generate: 0 is greedy", required=False)
    seed = _number("Seed", 0, "generate: sampling seed (+ the slice's index)", integer=True, required=False)
    top_k = _number(
        "Top k", None, "classify: the k largest logits (empty: every logit)", integer=True, required=False
    )
    batch_size = _number("Batch size", 8, "rows per forward pass", integer=True)
    workers = _number(
        "Workers",
        1,
        f"processing slices in parallel (1–{inference_spec.MAX_INFERENCE_WORKERS})",
        integer=True,
    )
    cpu = _number("CPU cores", 1.0)
    memory = _number("Memory (GB)", 1.0)
    storage = _number("Storage (GB)", 0.0)
    gpu = _number("GPU memory (GB)", 0.0)
    bid = _number("Bid", inference_spec.RoleSpec().price.bid, "public price per worker")
    max_price = _number("Maximum price", inference_spec.RoleSpec().price.max, "private; at least the bid")

    SECTIONS = (
        ("Job", ("name",)),
        (
            "Model",
            (
                "source_type",
                "repository",
                "revision",
                "filenames",
                "url",
                "upload",
                "model_config",
                "input_names",
            ),
        ),
        (
            "Data and task",
            ("dataset", "task", "max_new_tokens", "temperature", "seed", "top_k", "batch_size"),
        ),
        ("Each worker", ("workers", "cpu", "memory", "storage", "gpu", "bid", "max_price")),
    )

    def __init__(self, *args, owner, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from apps.datasets.models import Dataset

        self.owner = owner
        self.parsed: inference_spec.InferenceSpec | None = None
        names = list(Dataset.objects.order_by("name").values_list("name", "slice_count"))
        self.fields["dataset"].choices = [(name, f"{name} ({count} slices)") for name, count in names]
        if not names:
            self.fields["dataset"].help_text = "no data node has registered a dataset yet"

    def sections(self):
        return [(legend, [self[name] for name in names]) for legend, names in self.SECTIONS]

    def _source(self, data: dict) -> dict:
        kind = data.get("source_type")
        if kind == "huggingface":
            names = [name.strip() for name in (data.get("filenames") or "").split(",") if name.strip()]
            source = {"type": kind, "repository": data.get("repository") or "", "filenames": names}
            if data.get("revision"):
                source["revision"] = data["revision"]
            return source
        if kind == "url":
            return {"type": kind, "url": data.get("url") or ""}
        if kind == "upload":
            return {"type": kind, "file": data.get("upload") or ""}
        return {"type": "config", "config": data.get("model_config") or {}}

    def clean_model_config(self):
        text = (self.cleaned_data.get("model_config") or "").strip()
        if not text:
            return {}
        try:
            config = json.loads(text)
        except json.JSONDecodeError as error:
            raise forms.ValidationError(f"Not JSON: {error}") from None
        if not isinstance(config, dict):
            raise forms.ValidationError("A JSON object.")
        return config

    def specification(self) -> dict:
        """The JSON body the fields describe (without the name); a field that could not be read is left out."""
        data = self.cleaned_data
        task: dict = {"type": data.get("task")}
        if data.get("task") == "generate":
            for key in ("max_new_tokens", "temperature", "seed"):
                if data.get(key) is not None:
                    task[key] = data[key]
        elif data.get("task") == "classify" and data.get("top_k") is not None:
            task["top_k"] = data["top_k"]
        spec = {
            "model": {
                "source": self._source(data),
                "input_names": [n.strip() for n in (data.get("input_names") or "").split(",") if n.strip()],
            },
            "dataset": {"name": data.get("dataset")},
            "task": task,
            "batch_size": data.get("batch_size"),
            "workers": data.get("workers"),
            "worker": {
                "resources": {key: data.get(key) for key in ("cpu", "memory", "storage", "gpu")},
                "price": {"bid": data.get("bid"), "max": data.get("max_price")},
            },
        }
        # A field that could not be read is not sent: its own error is shown, the spec's would repeat it.
        for key in ("batch_size", "workers"):
            if spec[key] is None:
                del spec[key]
        for group in ("resources", "price"):
            spec["worker"][group] = {k: v for k, v in spec["worker"][group].items() if v is not None}
        return spec

    def clean(self):
        from apps.jobs.inference import submission

        cleaned = super().clean()
        unreadable = set(self.errors)
        try:
            parsed = inference_spec.parse_json(self.specification())
        except SpecError as error:
            for item in error.errors:
                self._spec_error(item["field"], item["message"], unreadable)
            return cleaned
        problems = submission.problems(parsed, self.owner)
        for path, messages in problems.items():
            for message in messages:
                self._spec_error(path, message, unreadable)
        if not problems and not unreadable:
            self.parsed = parsed
        return cleaned

    def _spec_error(self, path: str, message: str, unreadable: set) -> None:
        parts = path.split(".") if path else []
        field = None
        for length in range(len(parts), 0, -1):
            candidate = FIELD_OF_PATH.get(".".join(parts[:length]))
            if candidate in self.fields:
                field = candidate
                break
        if field in unreadable:
            return
        self.add_error(field, message)
