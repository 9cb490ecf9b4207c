"""parallel_gpt.py's tiny GPT counting its tokens (`batch_tokens`) and FLOPs (`flops_per_token`), for the throughput
columns of the log lines on every stack; the knobs of parallel_gpt.py apply."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import parallel_gpt  # noqa: E402  (tests/scripts/parallel_gpt.py)

FLOPS_PER_TOKEN = 1000.0  # a round number the test recomputes MFU with


class CountedRunner(parallel_gpt.TestRunner):
    def batch_tokens(self, batch):
        return batch[0].numel()  # (batch, block_size) token ids

    def flops_per_token(self):
        return FLOPS_PER_TOKEN


if __name__ == "__main__":
    CountedRunner(parallel_gpt.Config().parse()).train()
