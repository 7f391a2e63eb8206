"""The chain attention's per-piece call (attention over one piece with its log-sum-exp, which the merge needs)
through torch's public API against the private fused CPU kernel chatd calls (`chain_attention.partial_attention`):
`torch.nn.attention.flex_attention` with the log-sum-exp, eager (compiled flex attention on a CPU does not return
it), on the shapes of a SmolLM2 step (9 query heads, 3 key heads, head_dim 64): a batch of 16 or one row over a
1,000- or 200-token piece. Prints the milliseconds of each and the largest difference of their outputs.

    .venv/bin/python bench/chain_attention_api.py
"""

from __future__ import annotations

import json
import warnings

import torch
from common import mean_ms
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from chatd.engine.chain_attention import partial_attention

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def compare(rows: int, length: int) -> dict:
    """Both calls on random queries, keys and values of these sizes."""
    query = torch.randn(rows, HEADS, 1, HEAD_DIM)
    keys, values = torch.randn(KV_HEADS, length, HEAD_DIM), torch.randn(KV_HEADS, length, HEAD_DIM)
    stacked = query.transpose(0, 2).reshape(1, HEADS, rows, HEAD_DIM)  # the rows' queries as one sequence

    def private():
        return partial_attention(query, keys, values, 0.125)

    def public():
        return flex_attention(stacked, keys[None], values[None], scale=0.125, enable_gqa=True,
                              return_aux=AuxRequest(lse=True))

    output, _ = private()
    flex_output, _ = public()
    difference = (output.transpose(0, 2).reshape(1, HEADS, rows, HEAD_DIM) - flex_output).abs().max()
    return {"private_ms": mean_ms(private, 50), "flex_attention_ms": mean_ms(public, 50),
            "max_difference": float(difference)}


def main() -> None:
    warnings.filterwarnings("ignore")  # (flex attention warns that it runs unfused without torch.compile)
    torch.manual_seed(0)
    report = {}
    for rows, length in ((16, 1000), (1, 1000), (16, 200)):
        report[f"{rows} rows over {length} positions"] = compare(rows, length)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
