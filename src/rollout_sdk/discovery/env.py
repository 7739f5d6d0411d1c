"""How a client inside (or beside) a torchrun job finds the job's servers without being told.

``rollout_sdk.launch`` exports ``ROLLOUT_SDK_STORE`` (``host:port`` of the job's c10d store) and
``ROLLOUT_SDK_NUM_SERVERS`` to the driver; a process started elsewhere can set them itself.
"""

from __future__ import annotations

import os

from . import Discovery

__all__ = ["ENV_NUM_SERVERS", "ENV_PREFIX", "ENV_STORE", "discovery_from_env"]

ENV_STORE = "ROLLOUT_SDK_STORE"
ENV_NUM_SERVERS = "ROLLOUT_SDK_NUM_SERVERS"
ENV_PREFIX = "ROLLOUT_SDK_STORE_PREFIX"


def discovery_from_env() -> Discovery | None:
    store = os.environ.get(ENV_STORE)
    if not store:
        return None
    from .store import StoreDiscovery  # door: store

    num = os.environ.get(ENV_NUM_SERVERS)
    return StoreDiscovery(
        store,
        num_servers=int(num) if num else None,
        prefix=os.environ.get(ENV_PREFIX, "rollout_sdk"),
    )
