"""The overview's job list: the user's jobs (staff: everyone's), newest first, filtered by status and by text in
the name, a page of :data:`PAGE_SIZE` at a time (``/?status=running&q=gpt&page=2``)."""

from __future__ import annotations

from django.core.paginator import Paginator
from django.http import QueryDict

from apps.dashboard.snapshots import visible_jobs
from apps.jobs.models import Job
from worker_daemon.bounded_json import hostile_string_problem

PAGE_SIZE = 25


def job_list(user, params: QueryDict) -> dict:
    """The template context of the list: ``jobs`` (this page's), ``job_page`` (a Django ``Page``), the filters
    as given (an unknown status is ignored), ``job_filtered`` (whether any applies) and ``job_query`` (the
    filters as a query string, for the page links and the live refresh)."""
    jobs = visible_jobs(user)
    status = params.get("status", "")
    if status not in Job.Status.values:
        status = ""
    text = params.get("q", "").strip()[:200]
    if hostile_string_problem(text):  # NUL or a lone surrogate: no name holds one, and PostgreSQL refuses it
        text = ""
    if status:
        jobs = jobs.filter(status=status)
    if text:
        jobs = jobs.filter(name__icontains=text)
    page = Paginator(jobs, PAGE_SIZE).get_page(params.get("page"))
    query = QueryDict(mutable=True)
    if status:
        query["status"] = status
    if text:
        query["q"] = text
    return {
        "jobs": list(page.object_list),
        "job_page": page,
        "job_status": status,
        "job_text": text,
        "job_filtered": bool(status or text),
        "job_query": query.urlencode(),
        "status_choices": Job.Status.choices,
    }
