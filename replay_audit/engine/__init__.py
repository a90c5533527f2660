"""The replay engine: one checkpoint in one numerical configuration, behind a protocol.

Importing this package does not import torch. `load_engine` builds the real (torch) engine;
`FakeEngine` stands in for it in tests of code that only needs results.
"""

from __future__ import annotations

from replay_audit.engine.fake import FakeEngine
from replay_audit.engine.hashing import weights_sha256
from replay_audit.engine.pool import EnginePool, load_engine
from replay_audit.engine.protocol import (
    DecodeRequest,
    DecodeRun,
    DecodeWindow,
    Engine,
    Environment,
    Intervention,
    ScanItem,
    ScanRun,
    StepInfo,
    Steps,
    Target,
)

__all__ = [
    "DecodeRequest",
    "DecodeRun",
    "DecodeWindow",
    "Engine",
    "EnginePool",
    "Environment",
    "FakeEngine",
    "Intervention",
    "ScanItem",
    "ScanRun",
    "StepInfo",
    "Steps",
    "Target",
    "load_engine",
    "weights_sha256",
]
