"""Answers from a newer controller, read by an older client: fields it does not know are dropped, not fatal.

The wire models forbid unknown fields (``extra="forbid"``), which is right for what the controller *accepts*:
a misspelt spec field is a 422 naming it. But the controller's answers reuse those models (a job's ``spec``
is a :class:`~vigil.contract.schemas.JobCreate`), so a client one release older than its controller would
fail on every job the moment the controller learnt a new spec field. :func:`parse` reads an answer the way a
client should: every error other than an unknown field still raises; unknown fields are dropped, and
named once in a warning.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
_warned: set[tuple[str, str]] = set()


def parse(model: type[M], data: Any) -> M:
    """``model.model_validate(data)``, dropping the fields ``model`` does not know (a newer server's)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        if not errors or any(err["type"] != "extra_forbidden" for err in errors):
            raise
        for err in errors:
            _drop(data, err["loc"])
            where = ".".join(str(x) for x in err["loc"] if not isinstance(x, int))
            if (model.__name__, where) not in _warned:
                _warned.add((model.__name__, where))
                log.warning("the controller sent %s.%s, which this client does not know (a newer controller?): "
                            "ignored", model.__name__, where)
    return model.model_validate(data)


def _drop(data: Any, loc: tuple[int | str, ...]) -> None:
    """Remove the value at ``loc`` (a pydantic error location) from nested dicts and lists."""
    node = data
    for key in loc[:-1]:
        inside = (key in node) if isinstance(node, dict) else (
            isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node))
        if not inside:
            return  # a tagged-union step in the location (a model's name): not a key of the data
        node = node[key]
    if isinstance(node, dict):
        node.pop(loc[-1], None)
