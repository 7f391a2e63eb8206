"""What every OpenAI request body shares: unknown fields ignored (clients add their own), and `null` for a field
that has a default read as that default, as OpenAI's API reads it (its SDKs and many clients send `"temperature":
null`, `"n": null`, `"store": null` for "not given")."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class RequestBody(BaseModel):
    """The base of chat completions' and Responses' request bodies."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {name: value for name, value in data.items()
                if value is not None or (field := cls.model_fields.get(name)) is None or field.default is None}
