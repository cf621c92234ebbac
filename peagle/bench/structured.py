"""The structured-output workload (`--dataset structured`): short extraction tasks, each with the JSON schema its
answer must match, written for peagle's benchmarks (not taken from any benchmark set). Every request carries
OpenAI's `response_format` {"type": "json_schema"}; `peagle bench` sends it as a client would, and the offline
runner turns it into the engine's constraint."""
from __future__ import annotations

from collections.abc import Iterator

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 60}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "maxLength": 60}}}
EVENT = {"type": "object", "additionalProperties": False, "required": ["title", "date", "attendees"],
         "properties": {"title": {"type": "string", "maxLength": 80},
                        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                        "attendees": {"type": "array", "maxItems": 8,
                                      "items": {"type": "string", "maxLength": 40}}}}
PRODUCT = {"type": "object", "additionalProperties": False, "required": ["product", "price", "currency", "in_stock"],
           "properties": {"product": {"type": "string", "maxLength": 60}, "price": {"type": "number"},
                          "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]}, "in_stock": {"type": "boolean"}}}
REVIEW = {"type": "object", "additionalProperties": False, "required": ["sentiment", "rating", "topics"],
          "properties": {"sentiment": {"enum": ["positive", "negative", "mixed"]},
                         "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                         "topics": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 30}}}}

TASKS: list[tuple[str, str, dict]] = [
    ("person-1", "Maria Lopez is 34 years old and lives in Madrid, where she teaches chemistry.", PERSON),
    ("person-2", "Last week I met Kenji, a 27-year-old designer from Osaka.", PERSON),
    ("event-1", "The quarterly planning meeting is on 2025-03-14 with Ana, Ben and Chloe.", EVENT),
    ("event-2", "Join us for the product launch on 2024-11-02; Dev, Erin, Farid and Gus will present.", EVENT),
    ("product-1", "The Acme X200 headphones cost 89.99 US dollars and are currently in stock.", PRODUCT),
    ("product-2", "Sorry, the walnut desk (450 euros) is sold out until next month.", PRODUCT),
    ("review-1", "Great battery life and a sharp screen, but the speakers are weak. Four stars.", REVIEW),
    ("review-2", "Terrible service, cold food, and we waited an hour. One star.", REVIEW),
]
INSTRUCTION = "Extract the information from the text below as JSON with the fields {fields}.\n\nText: {text}"


def response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def iter_structured() -> Iterator[tuple[str, str, str, dict]]:
    """(id, prompt, category, response_format) of every task."""
    for task_id, text, schema in TASKS:
        category = task_id.split("-")[0]
        prompt = INSTRUCTION.format(fields=", ".join(schema["properties"]), text=text)
        yield task_id, prompt, category, response_format(category, schema)


def constraint_of(response_format: dict | None):
    """The engine's constraint for a workload prompt's response_format (None: free text)."""
    if not response_format:
        return None
    from peagle.engine.grammar import Constraint

    return Constraint.json_schema(response_format["json_schema"]["schema"])
