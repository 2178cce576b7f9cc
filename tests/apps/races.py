"""Running database workflows against each other in real threads (PostgreSQL race tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from django.db import connection, connections

#: The marks of a race test module: PostgreSQL only (SQLite serialises every writer of a process, so there
#: is no race to lose), and real transactions, so that each thread sees what the others commit.
RACE_TEST_MARKS = [
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="race tests need PostgreSQL (set DATABASE_URL): SQLite serialises all writers of a process",
    ),
    pytest.mark.django_db(transaction=True),
]


def run_together(*actions: Callable[[], object]) -> list[object]:
    """Run each action in its own thread, all released at once; return each result or the exception it raised."""
    barrier = threading.Barrier(len(actions))
    results: list[object] = [None] * len(actions)

    def run(index: int, action: Callable[[], object]) -> None:
        try:
            connection.ensure_connection()  # connect first, so the barrier releases queries, not handshakes
            barrier.wait(timeout=10)
            results[index] = action()
        except Exception as error:  # the test inspects it
            results[index] = error
        finally:
            connections.close_all()  # this thread's connection; the test database is dropped at the end

    threads = [threading.Thread(target=run, args=item) for item in enumerate(actions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a racing thread hung (deadlock?)"
    return results
