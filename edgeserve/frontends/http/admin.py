"""Non-inference JSON for the HTTP frontend: model config as Triton's protobuf-JSON."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

_INT64_TYPES = (
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
)


# -- model config ----------------------------------------------------------------------------------
def _numbers(value: Any, descriptor: Descriptor) -> None:
    """protobuf-JSON prints 64-bit integers as strings; Triton prints them as numbers."""
    if not isinstance(value, dict):
        return
    for field in descriptor.fields:
        if field.name not in value:
            continue
        item = value[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                for sub in item.values():
                    _numbers(sub, value_field.message_type)
            elif value_field.type in _INT64_TYPES:
                value[field.name] = {k: int(v) for k, v in item.items()}
        elif field.message_type is not None:
            for sub in item if isinstance(item, list) else [item]:
                _numbers(sub, field.message_type)
        elif field.type in _INT64_TYPES:
            value[field.name] = [int(v) for v in item] if isinstance(item, list) else int(item)


def config_to_json(config: Message) -> dict[str, Any]:
    """Model config as Triton's HTTP endpoint prints it: snake_case, defaults printed, enums as
    strings, 64-bit integers as JSON numbers."""
    result: dict[str, Any] = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _numbers(result, config.DESCRIPTOR)
    return result
