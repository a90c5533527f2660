"""The exception tree. Every domain error carries the HTTP status it maps to; one handler in
`replay_audit.api` renders them, the CLI prints their message.

    ReplayAuditError                 500  base class, never raised directly
    ├── BadRequest                   400
    │   └── FieldError               422  a named input field is invalid
    ├── NotAuthenticated             401  missing or unknown API key
    ├── PermissionDenied             403  the key's role may not do this
    ├── NotFound                     404  absent, or in another project
    ├── MethodNotAllowed             405  the path has no such method (`Allow` lists its methods)
    ├── Conflict                     409
    ├── PayloadTooLarge              413  oversized trace or batch
    ├── ServiceUnavailable           503  a dependency (database, job queue) cannot be reached
    │   ├── DatabaseUnavailable      503
    │   └── QueueUnavailable         503  the job queue (Redis) cannot take work
    └── EngineError                  500  the numerical engine could not do what was asked
        ├── UnsupportedFormat        422  e.g. an FP8 lm_head on a device below SM 8.9
        └── ModelMismatch            422  checkpoint weights_sha256 differs from the trace's
"""

from __future__ import annotations

from replay_audit.json_value import JsonObject


class ReplayAuditError(Exception):
    status_code = 500

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def to_dict(self) -> JsonObject:
        """The error body every answer renders (`api.errors.ErrorBody`)."""
        body: JsonObject = {"error": type(self).__name__, "detail": self.message}
        if self.field is not None:
            body["field"] = self.field
        return body


class BadRequest(ReplayAuditError):
    status_code = 400


class FieldError(BadRequest):
    status_code = 422


class NotAuthenticated(ReplayAuditError):
    status_code = 401


class PermissionDenied(ReplayAuditError):
    status_code = 403


class NotFound(ReplayAuditError):
    status_code = 404


class MethodNotAllowed(ReplayAuditError):
    status_code = 405


class Conflict(ReplayAuditError):
    status_code = 409


class PayloadTooLarge(ReplayAuditError):
    status_code = 413


class ServiceUnavailable(ReplayAuditError):
    status_code = 503


class DatabaseUnavailable(ServiceUnavailable):
    pass


class QueueUnavailable(ServiceUnavailable):
    pass


class EngineError(ReplayAuditError):
    status_code = 500


class UnsupportedFormat(EngineError):
    status_code = 422


class ModelMismatch(EngineError):
    status_code = 422
