from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0007_transfer_paths"),
    ]

    operations = [
        migrations.AddField(
            model_name="round",
            name="encoding",
            field=models.CharField(
                blank=True,
                default="",
                help_text="How the round's updates and result travelled: float32, float16, bfloat16 or int8 "
                "(empty: the parameter server did not say).",
                max_length=16,
            ),
        ),
    ]
