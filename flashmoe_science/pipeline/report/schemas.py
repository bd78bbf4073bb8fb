"""The shapes the report accepts for env.json, build.json, gates.json, sanitize.json,
selection.json and stages.json (bench.json has its own schema, benches/bench.schema.json).

The records may come from a pull request's code, so the report checks each against its schema
before using it: a record that does not match is named unreadable (exit 2), never half-rendered.
The schemas fix the types of the fields the report reads, bound the numbers (a 400-digit integer
is no register count) and the sizes; fields the report does not read are free. Every renderer
still treats what passes as untrusted text (flashmoe_science.pipeline.markdown escapes it).
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 32  # nesting levels any record may have; the real ones have fewer than 8
MAX_ITEMS = 100_000  # entries of any list (gate cases, kernels, checks)
_BIG = 1e15  # no count, size or time the report shows comes near this

_NUMBER = {"type": ["number", "null"], "minimum": -_BIG, "maximum": _BIG}
_INT = {"type": ["integer", "null"], "minimum": -_BIG, "maximum": _BIG}
_TEXT = {"type": ["string", "null"], "maxLength": 1_000_000}  # a build error, a long check detail
_SHORT = {"type": ["string", "null"], "maxLength": 1_000}
_SCALAR = {"type": ["string", "number", "boolean", "null"], "maxLength": 1_000}
_CAPABILITY = {
    "oneOf": [
        {"type": "string", "pattern": r"^(sm_)?[0-9]{1,2}(\.?[0-9])?[a-z]?$"},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "null"},
    ]
}
_COMMIT = {
    "type": "object",
    "properties": {
        "sha": {"type": ["string", "null"], "pattern": "^[0-9a-f]{4,64}$"},
        "dirty": {"type": ["boolean", "null"]},
        "fingerprint": {"type": ["string", "null"], "maxLength": 64},
    },
}
_PROVENANCE = {
    "type": ["object", "null"],
    "properties": {"commit": _COMMIT, "run_id": _SHORT},
}


# pipeline.load's block: the CPU count, and the load averages before and after
_LOAD_AVERAGES = {"type": ["array", "null"], "items": _NUMBER, "maxItems": 3}
_LOAD = {
    "type": ["object", "null"],
    "properties": {"cpus": _INT, "before": _LOAD_AVERAGES, "after": _LOAD_AVERAGES},
}


def _list(items: dict) -> dict:
    return {"type": ["array", "null"], "items": items, "maxItems": MAX_ITEMS}


def _record(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"provenance": _PROVENANCE, "schema": _SHORT, **properties},
        "required": list(required),
    }


ENV = _record(
    {
        "passed": {"type": ["boolean", "null"]},
        "require_gpu": {"type": ["boolean", "null"]},
        "backend": _SHORT,
        "torch": _SHORT,
        "python": _SHORT,
        "gpu": {
            "type": ["object", "null"],
            "properties": {
                "name": _SHORT,
                "capability": _CAPABILITY,
                "memory_gib": _NUMBER,
                "count": _INT,
            },
        },
        "cuda": {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {k: _SHORT for k in ("torch", "nvcc", "driver_version")},
                },
                _SHORT,
            ]
        },
        "checks": _list(
            {
                "type": "object",
                "properties": {"name": _SHORT, "status": _SHORT, "detail": _TEXT, "fix": _TEXT},
            }
        ),
        "load": _LOAD,
    }
)

_KERNEL = {
    "type": "object",
    "properties": {
        "kernel": _TEXT,
        "arch": _SHORT,
        **{
            key: _INT
            for key in (
                "registers",
                "smem_bytes",
                "dynamic_smem",
                "stack_bytes",
                "spill_stores",
                "spill_loads",
            )
        },
    },
}

BUILD = _record(
    {
        "status": _SHORT,
        "backend": _SHORT,
        "reason": _TEXT,
        "error": _TEXT,
        # The log the build wrote, by name only: the report reads build.log in the report folder
        # and nothing else, whatever this says.
        "log": _SHORT,
        "arch_list": _list(_CAPABILITY),
        "torch_version": _SHORT,
        "cuda_version": _SHORT,
        "nvcc_version": _SHORT,
        "elapsed_s": _NUMBER,
        "cold": {"type": ["boolean", "null"]},
        "compiler_warnings": _SCALAR,
        "kernels": _list(_KERNEL),
    }
)

_CASE = {
    "type": "object",
    "properties": {
        "case_id": _SHORT,
        "device": _SHORT,
        "outcome": _SHORT,
        "op": _SHORT,
        "dtype": _SHORT,
        "head_dim": _SCALAR,
        "seed": _SCALAR,
        "rerun": _SHORT,
        "rerun_cpu": _SHORT,
        "rerun_needs": _SHORT,
        "failures": _list(_TEXT),
        "worst": _list(_SCALAR),
        "row_profile": _list(_list(_SCALAR)),
        **{
            key: _NUMBER
            for key in ("max_diff", "mean_diff", "pt_max_diff", "floor", "bound", "ratio")
        },
        "nonfinite": _INT,
    },
}
_COUNTS = {"type": ["object", "null"], "additionalProperties": _INT}
# The run of main whose gate verdict a pull request's leg reused (gates.json) or looked up
# (selection.json): which run, of which commit, under which key.
_MAINS_RUN = {
    "sha": {"type": ["string", "null"], "pattern": "^[0-9a-f]{40}$"},
    "run_id": _SHORT,
    "run_url": _SHORT,
    "key": _SHORT,
}

GATES = _record(
    {
        "outcome": _SHORT,
        "reason": _TEXT,
        "pytest_exit": _INT,
        "gates": _COUNTS,
        "tests": _COUNTS,
        "selection": {
            "type": ["object", "null"],
            "properties": {
                "keyword": _SHORT,
                "markexpr": _SHORT,
                "gates_only": _SCALAR,
                "long": _SCALAR,
            },
        },
        "worst_max_diff": _NUMBER,
        "worst_ratio": _NUMBER,
        "worst_case": _SHORT,
        "restriction": _SHORT,
        "cases": _list(_CASE),
        "reused": {
            "type": ["object", "null"],
            "properties": {**_MAINS_RUN, "timestamp": _SHORT},
        },
        "workers": _list(
            {
                "type": "object",
                "properties": {
                    "id": _SHORT,
                    "cuda_visible_devices": _SHORT,
                    "gpu": _SHORT,
                    "gates": _INT,
                    "tests": _INT,
                },
            }
        ),
        "training": {
            "type": ["object", "null"],
            "properties": {
                "ours": {"type": "array", "items": _NUMBER, "maxItems": 2},
                "sdpa": {"type": "array", "items": _NUMBER, "maxItems": 2},
                "outcome": _SHORT,
            },
        },
    }
)

STAGES = _record(
    {
        "job_start": _NUMBER,
        "stages": {
            "type": ["object", "null"],
            "maxProperties": 64,
            "propertyNames": {"maxLength": 64},
            "additionalProperties": {
                "type": "object",
                "properties": {
                    "status": _SHORT,
                    "exit_code": _INT,
                    "seconds": _NUMBER,
                    "provenance": _PROVENANCE,
                },
            },
        },
    }
)

_SANITIZER_TOOL = {
    "type": "object",
    "properties": {
        "status": _SHORT,
        "coverage": _list(
            {
                "type": "object",
                "properties": {"feature": _SHORT, "status": _SHORT, "why": _SHORT},
            }
        ),
    },
}

SANITIZE = _record(
    {
        "status": _SHORT,
        "gpu": _SHORT,
        "sanitizer_version": _SHORT,
        "sanitizer_options": _list(_SHORT),
        "tools": {
            "type": ["object", "null"],
            "maxProperties": 16,
            "propertyNames": {"maxLength": 64},
            "additionalProperties": _SANITIZER_TOOL,
        },
    }
)

SELECTION = _record(
    {
        "mode": {"enum": ["full", "reuse"]},
        "reason": _TEXT,
        "base": _SHORT,
        "changed": _list(_SHORT),
        "gate_inputs": _list(_SHORT),
        "key": _SHORT,
        "kind": _SHORT,
        "main": {
            "type": ["object", "null"],
            "properties": {**_MAINS_RUN, "gates": _COUNTS, "tests": _COUNTS},
        },
    },
    required=("mode",),
)

SCHEMAS = {
    "env.json": ENV,
    "build.json": BUILD,
    "gates.json": GATES,
    "sanitize.json": SANITIZE,
    "selection.json": SELECTION,
    "stages.json": STAGES,
}


def depth(doc: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON document (iteratively: no recursion)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def problem(doc: dict, label: str) -> tuple[str | None, str | None]:
    """(why `doc`, the parsed `label`, does not match its schema; a caveat when it cannot be
    checked). Both None for a match or a file without a schema here."""
    schema = SCHEMAS.get(label)
    if schema is None:
        return None, None
    try:
        import jsonschema
    except ImportError:
        return None, f"{label} was not checked against its schema: jsonschema is not installed"
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(doc)
    )
    if error is None:
        return None, None
    where = "/".join(str(part) for part in error.absolute_path)[:120] or "(top level)"
    # The rule broken, not the value that broke it: the message would echo the value.
    rule = f"{error.validator} {error.validator_value!r}"[:120]
    return f"does not match the report's schema at {where}: fails {rule}", None
