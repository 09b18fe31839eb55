"""A client script for `ray job submit`: connects to a running deployment and prints one greedy completion.

    ray job submit --working-dir . -- python tests/cluster/job_client.py "def fib(n):" --max-tokens 16
"""

import argparse
import json

import numaserve as ns


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    parser.add_argument("--name", default="numaserve")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    client = ns.connect(args.name)
    done = client.generate(args.prompt, ns.SamplingParams(max_tokens=args.max_tokens, temperature=0))
    print("COMPLETION " + json.dumps({"token_ids": done.token_ids, "text": done.text,
                                      "finish_reason": done.finish_reason}))


if __name__ == "__main__":
    main()
