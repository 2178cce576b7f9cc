"""Users' API tokens, stored hashed (``UserToken``), replacing rest_framework.authtoken's plaintext table.

An install that had that app keeps its table, ``authtoken_token``: every key in it is moved here hashed (so the
keys people hold keep working) and the plaintext rows are deleted. The emptied table is left in place (the app's
own migration records still name it); nothing reads it any more.
"""

import hashlib
from datetime import UTC, datetime

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models

LEGACY_TABLE = "authtoken_token"


def hash_plaintext_tokens(apps, schema_editor) -> None:
    connection = schema_editor.connection
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        if LEGACY_TABLE not in connection.introspection.table_names(cursor):
            return
        cursor.execute(
            f"SELECT {quote('key')}, {quote('created')}, {quote('user_id')} FROM {quote(LEGACY_TABLE)}"
        )
        rows = cursor.fetchall()
    user_token = apps.get_model("workers", "UserToken")
    for key, created, user_id in rows:
        if isinstance(created, str):  # SQLite may hand the column back as text
            created = datetime.fromisoformat(created)
        if created.tzinfo is None:
            created = created.replace(tzinfo=UTC)
        user_token.objects.get_or_create(
            key_hash=hashlib.sha256(key.encode()).hexdigest(),
            defaults={"user_id": user_id, "key_prefix": key[:10], "created_at": created},
        )
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {quote(LEGACY_TABLE)}")


class Migration(migrations.Migration):
    dependencies = [
        ("workers", "0003_operator_caps"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="UserToken",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("key_hash", models.CharField(editable=False, max_length=64, unique=True)),
                (
                    "key_prefix",
                    models.CharField(editable=False, help_text="First characters of the key.", max_length=16),
                ),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now, editable=False)),
                ("last_used_at", models.DateTimeField(blank=True, editable=False, null=True)),
                (
                    "user",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="api_tokens",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "verbose_name": "API token",
                "ordering": ["-created_at"],
            },
        ),
        # The keys cannot be un-hashed: going back leaves the old table empty (its users need new tokens).
        migrations.RunPython(hash_plaintext_tokens, migrations.RunPython.noop),
    ]
