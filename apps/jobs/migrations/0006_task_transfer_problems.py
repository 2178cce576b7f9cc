from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0005_round_eval_error"),
    ]

    operations = [
        migrations.AddField(
            model_name="task",
            name="transfer_problems",
            field=models.JSONField(blank=True, default=dict),
        ),
    ]
