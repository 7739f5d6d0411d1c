"""A torchrun job for tests/test_trainer.py: rank 0 plays the trainer against the job's CPU-engine servers.

    torchrun --nproc-per-node 2 tests/jobs/trainer_checks.py --engine cpu --model DIR --report out.json

Each check records what it saw; the test asserts on the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import traceback
from typing import Any

import torch

from rollout_sdk import (
    Continuation,
    GenerateRequest,
    RolloutClient,
    SamplingParams,
    StalenessError,
    WeightUpdateError,
)
from rollout_sdk.launch import parse_launch_args, run

DIVERSE = {"presence_penalty": 2.0}  # greedy on a random model repeats one token; this spreads it
#: tokens of each request that a pause lands in: the pause comes a few steps after they all run
#: (all_running), so most of them are still to come
LONG = 40


def _args() -> argparse.Namespace:
    launch, rest = parse_launch_args()
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    a = p.parse_args(rest)
    a.model = launch.model
    return a


def reference_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with the presence penalty, by hand, on a plain HF model."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=ids).logits[0, -1].float()
            if out:
                seen = torch.tensor(sorted(set(out)))
                logits[seen] -= DIVERSE["presence_penalty"]
            nxt = int(logits.argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


async def all_running(client: RolloutClient, tasks: list[asyncio.Task[Any]]) -> None:
    """Until the servers run every one of ``tasks`` (a condition, not a sleep).  A pause then lands after the
    step in flight, which gives each its first token, if it had none yet."""
    while not any(t.done() for t in tasks):  # one done: the checks below say what went wrong
        stats = await asyncio.gather(*(s.fetch_stats() for s in client.servers))
        if sum(st.running for st in stats) >= len(tasks):
            return
        await asyncio.sleep(0.01)


async def checks(report: dict[str, Any], model_path: str) -> None:
    from transformers import AutoModelForCausalLM

    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, **DIVERSE)
    prompts = [[151644, 872, 198, 1000 + i] for i in range(4)]
    async with RolloutClient() as client:
        report["servers"] = [s.server_id for s in client.servers]
        ref = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, model_path, dtype=torch.float32)
        await client.init_weight_sync(backend="gloo")

        async def outputs() -> list[Any]:
            return list(await asyncio.gather(*(client.generate(p, sampling=greedy) for p in prompts)))

        before = await outputs()
        report["before_versions"] = sorted({r.weight_version for r in before})

        # 1. perturbed weights change the outputs, which equal a reference model with those weights
        g = torch.Generator().manual_seed(7)
        perturbed = [(n, t.detach() + 0.05 * torch.randn(t.shape, generator=g)) for n, t in ref.named_parameters()]
        stats = await client.update_weights(perturbed, version=1, bucket_bytes=8 << 20)
        report["update_stats"] = stats
        after = await outputs()
        ref.load_state_dict(dict(perturbed), strict=False)
        expected = [await asyncio.to_thread(reference_greedy, ref, p, 10) for p in prompts]
        report["changed"] = [a.output_ids != b.output_ids for a, b in zip(after, before, strict=True)]
        report["equal_reference"] = [a.output_ids == e for a, e in zip(after, expected, strict=True)]
        report["after_versions"] = sorted({r.weight_version for r in after})
        report["after_servers"] = sorted({r.server_id for r in after})

        # 2. wrong name / shape: a clear error, the old weights keep serving
        errors = []
        for bad in ([("model.no_such.weight", torch.zeros(3))], [(perturbed[0][0], torch.zeros(2, 2))]):
            try:
                await client.update_weights(bad + perturbed[1:3], version=99)
            except WeightUpdateError as exc:
                errors.append({"message": str(exc), "applied": exc.applied})
        report["bad_update_errors"] = errors
        still = await outputs()
        report["still_serving_old"] = [s.output_ids == a.output_ids for s, a in zip(still, after, strict=True)]
        report["version_after_refused"] = sorted({r.weight_version for r in still})

        # 3. an update during 100 in-flight requests with pause(hold): none lost, both versions in each
        long = SamplingParams(max_new_tokens=LONG, ignore_eos=True)
        tasks = [asyncio.create_task(client.generate([151644, 100 + i], sampling=long)) for i in range(100)]
        await all_running(client, tasks)
        g2 = torch.Generator().manual_seed(8)
        second = [(n, t + 0.01 * torch.randn(t.shape, generator=g2)) for n, t in perturbed]
        await client.update_weights(second, version=2, pause="hold", bucket_bytes=8 << 20)
        held = await asyncio.gather(*tasks, return_exceptions=True)
        report["hold_ok"] = sum(
            1
            for r in held
            if not isinstance(r, BaseException) and r.finish_reason == "length" and len(r.output_ids) == LONG
        )
        report["hold_errors"] = [repr(r) for r in held if isinstance(r, BaseException)][:3]
        report["hold_spanning"] = sum(
            1 for r in held if not isinstance(r, BaseException) and [v for v, _ in r.version_segments] == [1, 2]
        )

        # 4. pause(abort): every request returns its partial tokens, then resumes to completion
        reqs = [GenerateRequest(input_ids=[151644, 300 + i], sampling=long) for i in range(50)]
        conts = [Continuation(r) for r in reqs]
        tasks = [asyncio.create_task(client.generate(c.next_request())) for c in conts]
        await all_running(client, tasks)
        await client.pause("abort")
        partial = await asyncio.gather(*tasks)
        report["abort_partial"] = sum(1 for r in partial if r.finish_reason == "abort" and 0 < len(r.output_ids) < LONG)
        for c, r in zip(conts, partial, strict=True):
            c.add(r)
        await client.update_weights(perturbed, version=3)
        await client.resume()
        resumed = await asyncio.gather(
            *(client.generate(c.next_request(current_version=client.weight_version, max_staleness=2)) for c in conts)
        )
        for c, r in zip(conts, resumed, strict=True):
            c.add(r)
        finals = [c.result() for c in conts]
        report["abort_completed"] = sum(1 for f in finals if len(f.output_ids) == LONG and f.finish_reason == "length")
        report["abort_segments"] = sorted({tuple(v for v, _ in f.version_segments) for f in finals})
        report["abort_logprobs_aligned"] = all(len(f.logprobs or []) == LONG for f in finals)
        try:
            conts[0].next_request(current_version=10, max_staleness=2) if not conts[0].done else None
            fresh = Continuation(reqs[0])
            fresh.add(partial[0])
            fresh.next_request(current_version=5, max_staleness=2)
            report["staleness_refused"] = False
        except StalenessError as exc:
            report["staleness_refused"] = True
            report["staleness_message"] = str(exc)
        report["client_stats"] = {"completed": client.stats().completed, "errors": client.stats().errors}


async def main() -> None:
    a = _args()
    report: dict[str, Any] = {}
    try:
        await checks(report, a.model)
    except Exception:
        report["exception"] = traceback.format_exc()
    with open(a.report, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    raise SystemExit(run(main))
