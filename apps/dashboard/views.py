"""The dashboard's pages: overview, submit a job, a job, a worker. Login required; users see their own jobs and
the pool (every worker's public facts; in full the workers they own), staff see everything; another user's job
is a 404, as an unknown one is."""

from __future__ import annotations

import uuid

from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse, reverse_lazy
from django.views.decorators.http import require_http_methods, require_POST

from apps.dashboard import clone, compare, job_list, services, snapshots
from apps.dashboard.forms import DiLoCoJobForm, TomlJobForm
from apps.dashboard.inference import InferenceJobForm
from apps.dashboard.login import ThrottledAuthenticationForm
from apps.jobs.exceptions import JobNotCancellable
from apps.jobs.models import Job

#: The dashboard's own login page (the project's LOGIN_URL points at the admin's).
LOGIN_URL = reverse_lazy("dashboard:login")

dashboard_login_required = login_required(login_url=LOGIN_URL)

#: The id in the worker-page URL that the job page's script replaces with a worker's (dashboard.js).
WORKER_URL_PLACEHOLDER = "00000000-0000-0000-0000-000000000000"


class LoginView(auth_views.LoginView):
    template_name = "dashboard/login.html"
    form_class = ThrottledAuthenticationForm
    redirect_authenticated_user = True
    next_page = reverse_lazy("dashboard:overview")


class LogoutView(auth_views.LogoutView):
    next_page = LOGIN_URL


@dashboard_login_required
def overview(request: HttpRequest) -> HttpResponse:
    context = snapshots.overview(request.user)
    context.update(job_list.job_list(request.user, request.GET))
    # The page's script re-fetches the page with ?fragment=1 when something changed, and swaps the sections.
    template = (
        "dashboard/_overview_sections.html" if request.GET.get("fragment") else "dashboard/overview.html"
    )
    return render(request, template, context)


@dashboard_login_required
@require_http_methods(["GET", "POST"])
def submit_job(request: HttpRequest) -> HttpResponse:
    source = request.POST.get("source", "fields") if request.method == "POST" else "fields"
    # ?clone=<job id>: the fields filled in from one of the user's jobs (apps/dashboard/clone.py).
    cloned, initial, lost = None, None, []
    if request.method == "GET" and request.GET.get("clone"):
        try:
            cloned = _visible_job(request, uuid.UUID(request.GET["clone"]))
        except ValueError:
            raise Http404("No such job.") from None
        initial = clone.initial_for(cloned)
        lost = clone.lost_settings(cloned, initial, request.user)
    fields_form = DiLoCoJobForm(
        request.POST if source == "fields" and request.method == "POST" else None,
        owner=request.user,
        prefix="job",
        initial=initial,
    )
    toml_form = TomlJobForm(
        request.POST if source == "toml" else None,
        request.FILES if source == "toml" else None,
        owner=request.user,
        prefix="toml",
    )
    inference_form = InferenceJobForm(
        request.POST if source == "inference" else None, owner=request.user, prefix="inference"
    )
    form = {"toml": toml_form, "inference": inference_form}.get(source, fields_form)
    if request.method == "POST" and form.is_valid():
        submit = services.submit_inference if form is inference_form else services.submit
        job = submit(owner=request.user, name=form.cleaned_data["name"], parsed=form.parsed)
        messages.success(
            request, f"Job {job.name or job.pk} submitted: it is being advertised to the market."
        )
        for warning in job.submission_warnings:  # the connected fleet cannot serve it now
            messages.warning(request, f"Warning: {warning}.")
        return redirect("dashboard:job", job_id=job.pk)
    status = 400 if request.method == "POST" else 200
    return render(
        request,
        "dashboard/submit.html",
        {
            "form": fields_form,
            "toml_form": toml_form,
            "inference_form": inference_form,
            "source": source,
            "cloned": cloned,
            "lost": lost,
        },
        status=status,
    )


def _visible_job(request: HttpRequest, job_id) -> Job:
    job = snapshots.visible_jobs(request.user).filter(pk=job_id).first()
    if job is None:
        raise Http404("No such job.")
    return job


@dashboard_login_required
def job_detail(request: HttpRequest, job_id) -> HttpResponse:
    job = _visible_job(request, job_id)
    snapshot = snapshots.job_snapshot(job)
    owner = job.owner_id == request.user.pk
    context = {
        "job": job,
        "snapshot": snapshot,
        # The owner's Discard button: the API's URL (round 0 for the number, the page's script puts the round's)
        # and the round it shows on now; the script keeps it right as rounds close (docs/dashboard.md).
        "discard_url": reverse("job-discard", kwargs={"pk": job.pk, "number": "0"}) if owner else "",
        "discard_round": _discardable_round(snapshot) if owner else None,
        "websocket_path": f"/ws/dashboard/jobs/{job.pk}/",
        "model_url": reverse("job-model", kwargs={"pk": job.pk}),
        # An inference job shows its slices, workers and results instead of rounds, trainers and loss charts.
        "inference": snapshot["inference"],
        # The page's script links each worker to its page: this URL with the worker's id for the zero UUID.
        "worker_url_template": reverse("dashboard:worker", kwargs={"worker_id": WORKER_URL_PLACEHOLDER}),
        **snapshots.job_page(job),
    }
    return render(request, "dashboard/job.html", context)


def _discardable_round(snapshot: dict) -> int | None:
    """The round an owner may discard (the API checks again): a running job's latest closed round, when it is
    neither discarded nor asked to be and is not the job's last round. Refusals the page cannot see (the job's
    overlap or encoding) come back as the API's 409 reason."""
    job = snapshot["job"]
    closed = [round_ for round_ in snapshot["rounds"] if round_["closed"]]
    if job["status"] != Job.Status.RUNNING or not closed:
        return None
    last = max(closed, key=lambda round_: round_["number"])
    if last["discarded"] or last["discard_requested_at"]:
        return None
    if job["update_rounds"] and last["number"] >= job["update_rounds"]:
        return None
    return last["number"]


@dashboard_login_required
def compare_jobs(request: HttpRequest) -> HttpResponse:
    """``?ids=a,b`` (or ``?ids=a&ids=b``, as the overview's checkboxes send them): the jobs' curves overlaid.
    Ids of other users' jobs are left out with a message; if none is left, a 404."""
    ids, unreadable = compare.requested_ids(request.GET.getlist("ids"))
    if not ids and not unreadable:
        messages.info(request, "Tick two or more jobs in the list to compare them.")
        return redirect("dashboard:overview")
    context = compare.comparison(request.user, ids)
    if not context["jobs"]:
        raise Http404("No such job.")
    left_out = context["left_out"] + unreadable
    if left_out:
        messages.warning(
            request,
            f"{left_out} of the jobs asked for {'is' if left_out == 1 else 'are'} not yours, unknown "
            f"or beyond the first {compare.MAX_JOBS}: left out.",
        )
    return render(request, "dashboard/compare.html", context)


@dashboard_login_required
@require_POST
def cancel_job(request: HttpRequest, job_id) -> HttpResponse:
    with transaction.atomic():
        job = _visible_job(request, job_id)
        try:
            services.cancel(job, by=request.user)
        except JobNotCancellable as error:
            messages.error(request, str(error))
        else:
            messages.success(request, "Job cancelled: its leases are released and its tasks stopped.")
    return redirect("dashboard:job", job_id=job.pk)


@dashboard_login_required
def worker_detail(request: HttpRequest, worker_id) -> HttpResponse:
    worker = snapshots.visible_workers(request.user).filter(pk=worker_id).first()
    if worker is None:
        raise Http404("No such worker.")
    return render(
        request,
        "dashboard/worker.html",
        {"worker": worker, **snapshots.worker_page(worker, request.user)},
    )
