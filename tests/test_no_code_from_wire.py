"""No code from the wire: nothing in src/ imports, unpickles or evaluates something a message names.

The test greps every source file for the constructs that turn data into code (dynamic imports, pickle and
its relatives, eval/exec, attribute lookups on the torch module, torch.load, SGLang's serializer) and
fails on any occurrence that is not in ``REVIEWED`` below, where each entry says why its input never comes
from a peer.  A new occurrence needs a review and an entry here (docs/security.md, "no code from the wire").
"""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "rollout_sdk"

PATTERNS = {
    "dynamic import": re.compile(r"\bimport_module\s*\(|\b__import__\s*\(|\bimportlib\.util\.spec_from"),
    "pickle": re.compile(r"\b(c?pickle|dill|cloudpickle|marshal|shelve)\b|ForkingPickler|\.deserialize\s*\("),
    "eval/exec": re.compile(r"(?<![.\w])(eval|exec|compile)\s*\("),
    "torch attribute by name": re.compile(r"getattr\(\s*torch\s*,"),
    "torch.load": re.compile(r"\btorch\.load\s*\(|weights_only\s*=\s*False"),
    "yaml.load": re.compile(r"\byaml\.(unsafe_)?load\s*\("),
}

#: (file relative to src/rollout_sdk, pattern name, the line's text stripped) -> why it is safe
REVIEWED: dict[tuple[str, str, str], str] = {
    (
        "launch/main.py",
        "dynamic import",
        'fn: Any = getattr(importlib.import_module(module), func or "main")',
    ): "--driver module:function from the command line of the job's own launcher, not from a message",
    (
        "engines/cpu/model_runner.py",
        "torch attribute by name",
        "dtype = getattr(torch, self.config.dtype)",
    ): "CpuEngineConfig.dtype, set by the operator who starts the server (never by a message)",
    (
        "__init__.py",
        "dynamic import",
        "value = getattr(importlib.import_module(module), name)",
    ): "the root's lazy engine-side names: constant module paths in _ENGINE_SIDE, keyed by a Python attribute name",
}


def _hits() -> list[tuple[str, str, str, int]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if code.lstrip().startswith(('"', "'")) or not code.strip():
                continue
            for name, pattern in PATTERNS.items():
                if pattern.search(code):
                    found.append((rel, name, line.strip(), lineno))
    return found


def _in_docstring(rel: str, lineno: int) -> bool:
    """Lines inside a triple-quoted string (prose that names these functions) are not code."""
    inside = False
    for i, line in enumerate((SRC / rel).read_text().splitlines(), 1):
        if i == lineno:
            return inside
        inside ^= (line.count('"""') + line.count("'''")) % 2 == 1
    return False


def test_no_unreviewed_code_from_data_in_src() -> None:
    hits = [h for h in _hits() if not _in_docstring(h[0], h[3])]
    unreviewed = [f"{rel}:{n}: [{name}] {text}" for rel, name, text, n in hits if (rel, name, text) not in REVIEWED]
    assert not unreviewed, "new import/pickle/eval constructs need a review entry:\n" + "\n".join(unreviewed)


def test_every_reviewed_exception_still_exists() -> None:
    present = {(rel, name, text) for rel, name, text, _ in _hits()}
    stale = [k for k in REVIEWED if k not in present]
    assert not stale, f"remove stale review entries: {stale}"


def test_the_grep_catches_what_it_is_for() -> None:
    samples = [
        "mod = importlib.import_module(msg.module)",
        "obj = pickle.loads(frame)",
        "value = eval(expr)",
        "dt = getattr(torch, meta.dtype)",
        "state = torch.load(path, weights_only=False)",
        "x = MultiprocessingSerializer.deserialize(data)",
    ]
    for s in samples:
        assert any(p.search(s) for p in PATTERNS.values()), s
    assert not any(p.search("model.eval()") for p in PATTERNS.values())


def test_ipc_storage_class_and_dtype_come_from_allowlists() -> None:
    import pytest

    from rollout_sdk.errors import InvalidRequestError
    from rollout_sdk.weights.buckets import torch_dtype
    from rollout_sdk.weights.ipc import STORAGE_CLASSES, storage_class

    for name in STORAGE_CLASSES:
        assert storage_class(name).__name__ == name.rsplit(".", 1)[1]
    for evil in ("os.system", "builtins.eval", "subprocess.Popen", "torch.storage.TypedStorage.x", ""):
        with pytest.raises(InvalidRequestError, match="storage_cls"):
            storage_class(evil)
    assert str(torch_dtype("bfloat16")) == "torch.bfloat16"
    for evil in ("load", "save", "__class__", "ops"):
        with pytest.raises(InvalidRequestError, match="dtype"):
            torch_dtype(evil)


def test_a_malicious_ipc_handle_is_refused_before_anything_is_imported() -> None:
    import sys

    import msgspec
    import pytest

    from rollout_sdk.errors import InvalidRequestError
    from rollout_sdk.protocol import TensorMeta
    from rollout_sdk.weights.ipc import CudaIpcHandle, sglang_bucket_payload

    def handle(storage_cls: str, dtype: str = "float32") -> bytes:
        return msgspec.msgpack.encode(
            CudaIpcHandle(
                size=[4], stride=[1], offset=0, dtype=dtype, device_uuid="GPU-0", storage_cls=storage_cls,
                storage_handle=b"h", storage_size_bytes=16, storage_offset_bytes=0, ref_counter_handle=b"r",
                ref_counter_offset=0, event_handle=None, event_sync_required=False,
            )
        )  # fmt: skip

    meta = [TensorMeta("w", "float32", [4])]
    before = set(sys.modules)
    for bad in (handle("os.system"), handle("subprocess.Popen"), handle("torch.storage.TypedStorage", "load")):
        with pytest.raises(InvalidRequestError):
            sglang_bucket_payload(bad, meta)
    with pytest.raises(InvalidRequestError, match="dtype"):
        sglang_bucket_payload(handle("torch.storage.TypedStorage"), [TensorMeta("w", "__class__", [4])])
    with pytest.raises(InvalidRequestError, match="not a CUDA IPC handle"):
        sglang_bucket_payload(b"\x93garbage", meta)
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("os", "subprocess", "sglang")}
