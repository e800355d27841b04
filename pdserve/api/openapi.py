"""The OpenAPI document of the public API a worker and the proxy serve, built from the wire models.

The generation routes read raw bodies and validate them with these same models
(`pdserve.api.validation`), so FastAPI cannot see their bodies and its own
schema would be empty; this module describes them instead, and both apps serve
it at `GET /openapi.json` (what clients generate bindings from, and what the
schema fuzzing in tests/integration/test_schema_fuzz.py runs against).
Torch-free.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel

from pdserve.api.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, ErrorResponse, ModelList)
from pdserve.api.tokenize_protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

OPENAPI_PATH = "/openapi.json"
PROTOCOL_VERSION_LABEL = "1"  # the document's own version: bumped when an operation or model changes
_REF = "#/components/schemas/{model}"

# (method, path, summary, request model, response model): what a worker and the proxy both serve.
OPERATIONS: tuple[tuple[str, str, str, Optional[type[BaseModel]], type[BaseModel]], ...] = (
    ("post", "/v1/completions", "Text completion (streams with stream=true)", CompletionRequest,
     CompletionResponse),
    ("post", "/v1/chat/completions", "Chat completion (streams with stream=true)", ChatCompletionRequest,
     ChatCompletionResponse),
    ("get", "/v1/models", "The model served", None, ModelList),
    ("post", "/tokenize", "Text or chat messages to token ids", TokenizeRequest, TokenizeResponse),
    ("post", "/detokenize", "Token ids to text", DetokenizeRequest, DetokenizeResponse),
)


def _schema(model: type[BaseModel], definitions: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF)
    definitions.update(schema.pop("$defs", {}))
    definitions[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def openapi_document(title: str, version: str) -> dict[str, Any]:
    """OpenAPI 3.1 for `OPERATIONS`: bodies from the request models, answers from the response
    models, every error as an OpenAI-style `ErrorResponse`."""
    definitions: dict[str, Any] = {}
    error = {"description": "OpenAI-style error", "content": {"application/json": {
        "schema": _schema(ErrorResponse, definitions)}}}
    paths: dict[str, Any] = {}
    for method, path, summary, request, response in OPERATIONS:
        operation: dict[str, Any] = {
            "summary": summary,
            "responses": {"200": {"description": "OK", "content": {"application/json": {
                "schema": _schema(response, definitions)}}}, "4XX": error, "5XX": error},
        }
        if request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": _schema(request, definitions)}}}
        paths.setdefault(path, {})[method] = operation
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": definitions}}
