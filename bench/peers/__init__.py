"""The SGLang side of the GPU benches: the model they start, and the peers they hold rollout-sdk against on
the very engine the SDK serves.

* :mod:`peers.shapes` -- the dummy-weight Qwen2.5-shaped model (``model_dir``), the ``SglangEngineConfig``
  the benches start on it (``dummy_engine_config``), the trainer's weights of that shape (``hf_named``);
* :mod:`peers.raw` -- raw SGLang: ``sglang.Engine.async_generate`` on the engine an ``SglangEngine`` wraps,
  in the bench's own process, as a user's naive call (the fake engine's ``generate`` on a CPU dry run);
* :mod:`peers.http_server` -- SGLang's HTTP server (``python -m sglang.launch_server`` with the same engine
  arguments and KV pool) driven with ``POST /generate``: the slime / AReaL path; an aiohttp stand-in over
  the fake engine on a CPU dry run.

Scripts run as ``python bench/<name>.py``, so bench/ is on ``sys.path`` and this package imports as
``peers``.  Nothing here runs at import time.
"""
