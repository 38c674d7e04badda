"""The base of every config section."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base for every config section: strict types, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)
