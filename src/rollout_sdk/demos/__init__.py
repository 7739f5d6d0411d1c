"""Runnable demos (``rollout-sdk demo``, ``rollout-sdk grpo``): read them as examples of the public API."""
