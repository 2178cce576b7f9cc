from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0013_job_stop_after_round"),
    ]

    operations = [
        migrations.AddField(
            model_name="round",
            name="verdicts",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text='Worker id → the parameter server\'s verdict on its update: {"verdict": "accepted" | '
                '"down-weighted" | "rejected", "reason": str, "norm_ratio": float | null, "cosine": '
                "float | null} (empty: the round was not verified; docs/training.md).",
            ),
        ),
    ]
