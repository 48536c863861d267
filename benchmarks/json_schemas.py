"""Twenty JSON schemas for benchmarks/structured.py: nested objects, arrays, enums, numbers and
required fields, each with a name the prompt asks for."""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


def _str(n: int = 24) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def _enum(*values: Any) -> dict[str, Any]:
    return {"enum": list(values)}


def _int(lo: int = 0, hi: int = 1000) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num() -> dict[str, Any]:
    return {"type": "number"}


def _list(items: dict[str, Any], n: int = 3) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": n}


_ADDRESS = _obj(
    {"street": _str(), "city": _str(16), "zip": {"type": "string", "pattern": "[0-9]{5}"}}
)

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("person", _obj({"name": _str(), "age": _int(0, 120), "email": _str(32)}, ["name", "age"])),
    ("address", _ADDRESS),
    ("customer", _obj({"id": _int(), "name": _str(), "address": _ADDRESS})),
    (
        "order",
        _obj(
            {
                "order_id": _int(),
                "items": _list(_obj({"sku": _str(8), "qty": _int(1, 9)})),
                "status": _enum("new", "paid", "shipped"),
            }
        ),
    ),
    (
        "product",
        _obj(
            {
                "name": _str(),
                "price": _num(),
                "in_stock": {"type": "boolean"},
                "tags": _list(_str(10)),
            }
        ),
    ),
    (
        "weather",
        _obj({"city": _str(16), "celsius": _num(), "sky": _enum("clear", "cloudy", "rain")}),
    ),
    (
        "event",
        _obj(
            {
                "title": _str(),
                "day": _int(1, 31),
                "month": _int(1, 12),
                "attendees": _list(_str(12), 4),
            }
        ),
    ),
    (
        "book",
        _obj(
            {
                "title": _str(),
                "author": _str(),
                "year": _int(1500, 2030),
                "genre": _enum("fiction", "science", "history"),
            }
        ),
    ),
    ("point", _obj({"x": _num(), "y": _num()})),
    (
        "rectangle",
        _obj(
            {
                "top_left": _obj({"x": _int(), "y": _int()}),
                "size": _obj({"w": _int(1, 99), "h": _int(1, 99)}),
            }
        ),
    ),
    (
        "log_entry",
        _obj(
            {
                "level": _enum("debug", "info", "warning", "error"),
                "message": _str(40),
                "code": _int(0, 999),
            },
            ["level", "message"],
        ),
    ),
    (
        "user_settings",
        _obj(
            {
                "theme": _enum("light", "dark"),
                "font_size": _int(8, 32),
                "notifications": {"type": "boolean"},
            }
        ),
    ),
    (
        "recipe",
        _obj(
            {
                "name": _str(),
                "servings": _int(1, 12),
                "ingredients": _list(_obj({"item": _str(12), "grams": _int(1, 999)}), 3),
            }
        ),
    ),
    (
        "flight",
        _obj(
            {
                "number": {"type": "string", "pattern": "[A-Z]{2}[0-9]{3}"},
                "origin": _str(3),
                "destination": _str(3),
                "seats": _int(1, 400),
            }
        ),
    ),
    ("matrix", _obj({"rows": _int(1, 3), "values": _list(_list(_int(0, 9), 3), 3)})),
    (
        "api_response",
        _obj(
            {
                "ok": {"type": "boolean"},
                "error": _str(30),
                "data": _obj({"count": _int(), "next": _str(16)}),
            },
            ["ok", "data"],
        ),
    ),
    (
        "employee",
        _obj(
            {
                "name": _str(),
                "role": _enum("engineer", "manager", "sales"),
                "salary": _int(1000, 99999),
                "manager": _str(),
            },
            ["name", "role"],
        ),
    ),
    ("color", _obj({"name": _str(12), "rgb": _list(_int(0, 255), 3)})),
    ("review", _obj({"stars": _int(1, 5), "text": _str(40), "helpful": {"type": "boolean"}})),
    (
        "task",
        _obj(
            {
                "title": _str(),
                "done": {"type": "boolean"},
                "priority": _enum(1, 2, 3),
                "subtasks": _list(_obj({"title": _str(16), "done": {"type": "boolean"}}), 2),
            }
        ),
    ),
]
