"""Moving weights from a trainer into engines: process groups, flattened buckets, CUDA IPC handles.

Weights never travel through ZMQ: control messages carry names, dtypes and shapes; the bytes move by
broadcast in a weight-update process group (NCCL on GPU, gloo on CPU) or, colocated, as CUDA IPC handles.
"""

from .buckets import Bucket, plan_buckets, receive_buckets, send_buckets, unflatten
from .group import Rendezvous, destroy_weight_group, init_weight_group, master_store

__all__ = [
    "Bucket",
    "Rendezvous",
    "destroy_weight_group",
    "init_weight_group",
    "master_store",
    "plan_buckets",
    "receive_buckets",
    "send_buckets",
    "unflatten",
]
