"""Engine backends behind one interface (:class:`~rollout_sdk.engines.base.Engine`).

``cpu`` (HF transformers, the embedded default), ``sglang`` (GPU; imports sglang lazily), ``fake``
(scriptable, for tests and benchmarks).  Importing this package imports no backend.
"""
