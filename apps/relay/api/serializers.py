"""The relay API's bodies: inputs (checked here for shape; the services check the rest) and answers (the
services build them; these serializers document them in the OpenAPI schema)."""

from __future__ import annotations

from rest_framework import serializers

from hypha_site.api import StrictSerializer

MAX_WAIT = 30.0

KEY_HELP = (
    "updates/<round>/<peer>, results/<round>, model/<round>/<filename> (round 1..999999999, 0 allowed for "
    "model; peer a lower-case UUID; filename [A-Za-z0-9_][A-Za-z0-9._-]{0,99})"
)


# --- inputs ---------------------------------------------------------------------------------------------------


class BeginUploadSerializer(StrictSerializer):
    key = serializers.CharField(max_length=200, trim_whitespace=False, help_text=KEY_HELP)
    size = serializers.IntegerField(min_value=0, help_text="bytes of the whole object")
    sha256 = serializers.CharField(
        min_length=64, max_length=64, trim_whitespace=False, help_text="SHA-256 of the object, lower-case hex"
    )
    metadata = serializers.DictField(
        required=False,
        default=dict,
        help_text=(
            "a flat object of strings, integers, numbers, booleans and lists of strings; at most 8 KiB of JSON"
        ),
    )


class KeySerializer(StrictSerializer):
    key = serializers.CharField(max_length=200, trim_whitespace=False, help_text=KEY_HELP)


class ReplySerializer(StrictSerializer):
    key = serializers.CharField(max_length=200, trim_whitespace=False, help_text=KEY_HELP)
    status = serializers.IntegerField(min_value=100, max_value=599, help_text="an HTTP status")
    body = serializers.DictField(help_text="a JSON object, at most 8 KiB")


class WaitSerializer(serializers.Serializer):
    wait = serializers.FloatField(
        required=False,
        default=0.0,
        min_value=0.0,
        max_value=MAX_WAIT,
        help_text="seconds to wait for an answer before giving up (0 to 30)",
    )


class ObjectQuerySerializer(WaitSerializer):
    key = serializers.CharField(
        required=False,
        max_length=200,
        trim_whitespace=False,
        help_text=f"{KEY_HELP}; or model/latest/<filename>",
    )
    prefix = serializers.CharField(
        required=False,
        max_length=200,
        trim_whitespace=False,
        help_text="list the complete objects under this prefix (updates/, results/ or model/…) instead",
    )

    def validate(self, attrs: dict) -> dict:
        if ("key" in attrs) == ("prefix" in attrs):
            raise serializers.ValidationError({"key": ["Give either key or prefix."]})
        return attrs


class ReplyQuerySerializer(WaitSerializer):
    key = serializers.CharField(max_length=200, trim_whitespace=False, help_text=KEY_HELP)


class DeleteQuerySerializer(serializers.Serializer):
    key = serializers.CharField(max_length=200, trim_whitespace=False, help_text=KEY_HELP)


# --- answers --------------------------------------------------------------------------------------------------


class PartSerializer(serializers.Serializer):
    number = serializers.IntegerField(help_text="1-based")
    offset = serializers.IntegerField(help_text="where the part starts in the object")
    size = serializers.IntegerField(help_text="bytes: PUT exactly this many, with Content-Length")
    url = serializers.CharField(allow_null=True, help_text="where to PUT the part; null when done")
    done = serializers.BooleanField(help_text="stored already (a resumed upload skips it)")


class UploadPlanSerializer(serializers.Serializer):
    key = serializers.CharField()
    size = serializers.IntegerField()
    sha256 = serializers.CharField()
    part_size = serializers.IntegerField()
    parts = PartSerializer(many=True)
    expires_in = serializers.IntegerField(help_text="seconds the part URLs stay valid")
    status = serializers.ChoiceField(choices=["pending", "complete"])


class ReplyAnswerSerializer(serializers.Serializer):
    status = serializers.IntegerField()
    body = serializers.DictField()


class RelayObjectSerializer(serializers.Serializer):
    key = serializers.CharField(help_text="the object's own key (model/<round>/… for model/latest/…)")
    size = serializers.IntegerField()
    sha256 = serializers.CharField(help_text="check it at the end of the download")
    metadata = serializers.DictField()
    writer = serializers.CharField(help_text="the writer's peer (worker id)")
    created_at = serializers.DateTimeField(help_text="when the object became complete")
    url = serializers.CharField(help_text="GET it (Range supported); no other credential needed")
    expires_in = serializers.IntegerField(help_text="seconds the URL stays valid")
    reply = ReplyAnswerSerializer(allow_null=True)


class RelayObjectListSerializer(serializers.Serializer):
    objects = RelayObjectSerializer(many=True)


class WantAcceptedSerializer(serializers.Serializer):
    key = serializers.CharField()


class WantsSerializer(serializers.Serializer):
    wants = serializers.ListField(child=serializers.CharField())
