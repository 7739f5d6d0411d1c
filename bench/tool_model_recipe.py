"""Train variants of the tool model's recipe and print held-back accuracy along the way: the evidence
behind the defaults of ``rollout_sdk.tasks.tool_model.Recipe`` (see docs/benchmarks.md#the-tool-model and
docs/benchmarks-changelog.md).

    python bench/tool_model_recipe.py --seeds 0 1 2 3                   # the default recipe, four seeds
    python bench/tool_model_recipe.py --seeds 0 1 --lr 5e-3 --steps 700  # a variant

Each run trains the first stage only (``detune_steps=0``) with one thread and scores teacher-forced greedy
exact match (every model token the argmax) on held-back instances every ``--every`` steps, with the task's
own calculator definition and with each held-back definition (``tasks/calculator_schemas.py``); the table
shows the worse of the two.  Seeds run one
after another; a table (rows: seeds, columns: steps) is printed last.
"""

from __future__ import annotations

import time

import harness
from transformers import AutoTokenizer

from rollout_sdk.models import ensure_tiny_model
from rollout_sdk.tasks.tool_model import Recipe, demonstration_sets, train_stages


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=Recipe.steps)
    p.add_argument("--batch", type=int, default=Recipe.batch)
    p.add_argument("--lr", type=float, default=Recipe.lr)
    p.add_argument("--warmup", type=int, default=Recipe.warmup)
    p.add_argument("--schema-variants", type=int, default=Recipe.schema_variants)
    p.add_argument("--canonical-fraction", type=float, default=Recipe.canonical_fraction)
    p.add_argument("--own-steps", type=int, default=Recipe.own_steps)
    p.add_argument("--own-loss", type=float, default=Recipe.own_loss)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--home", default=None)
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model(args.home)))
    table: dict[int, dict[int, float]] = {}
    for seed in args.seeds:
        recipe = Recipe(
            seed=seed,
            steps=args.steps,
            batch=args.batch,
            lr=args.lr,
            warmup=args.warmup,
            detune_steps=0,
            schema_variants=args.schema_variants,
            canonical_fraction=args.canonical_fraction,
            own_steps=args.own_steps,
            own_loss=args.own_loss,
        )
        data = demonstration_sets(tokenizer, recipe)
        row: dict[int, float] = {}
        t0 = time.process_time()

        def on_eval(
            step: int, loss: float, scores: dict[str, float], row: dict[int, float] = row, seed: int = seed
        ) -> None:
            row[step] = min(scores["greedy"], scores["schemas"])
            print(
                f"seed {seed} step {step:>5} loss {loss:.4f} exact {scores['greedy']:.3f} "
                f"held-back definitions (worst) {scores['schemas']:.3f}",
                flush=True,
            )

        train_stages(data, recipe, on_eval=on_eval, eval_every=args.every)
        print(f"seed {seed}: {time.process_time() - t0:.0f} CPU-s", flush=True)
        table[seed] = row
    print(f"\n{recipe}, seeds {args.seeds}")
    steps = sorted({s for row in table.values() for s in row})
    rows = [[seed, *(f"{row.get(s, float('nan')):.2f}" for s in steps)] for seed, row in table.items()]
    print(harness.table(["seed", *map(str, steps)], rows, left=()))


if __name__ == "__main__":
    main()
