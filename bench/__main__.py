"""python -m bench: how fast Stop stops, and what else Stopline's speed depends on.

    python -m bench run [--engines ours,baseline,llama-server ...]  the scenarios against the servers it starts
                                                          (the default: ``python -m bench --engines ...``)
    python -m bench render [--out DIR] [--results-md]     the tables, chart and RESULTS.md section again
    python -m bench one-user | auth-flood                 a measurement against a Stopline of its own
    python -m bench faults churn | kill                   memory under keep-alive churn; a replica killed
    python -m bench faults cache-churn [--minutes 30]     the prompt cache's memory and disk against their
                                                          budgets under varied prompts
    python -m bench priority [--rounds 3]                 TTFT of users beyond the workers, and of a request
                                                          of higher priority among long generations
    python -m bench native | llama-native | structured    the engines' loops in-process
    python -m bench random-llama [--layers N]             the Llama-3.2-1B-shaped model file
    python -m bench serve --engine NAME ...               one server, as ``run`` starts them
    python -m bench prompt-cache --build-llama-server     agent-like conversations, a stopped prompt edited and
                                                          sent again, a restart: the prompt cache against cold
    python -m bench aiperf --build-llama-server [--concurrency 1,2,4,8,16]
                                                          NVIDIA's AIPerf against Stopline and llama-server
    python -m bench embeddings --build-llama-server       all-MiniLM-L6-v2: Stopline's numpy against llama-server
                                                          on the GGUF file converted from it
    python -m bench responses-cancel [--rounds 100]       the Responses API's cancel against DELETE, on one server
    python -m bench gpu-check [--pack DIR] [--backend cpu]  the CUDA engine against llama-server, offline, in one
                                                          table (docs/benchmarks.md, "The GPU check")

``python -m bench COMMAND --help`` says more; the microbenchmarks are ``python -m pytest bench/ --benchmark-only``.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "run": "bench.run:main",
    "render": "bench.run:render",
    "one-user": "bench.tools.one_user:main",
    "auth-flood": "bench.tools.auth_flood:main",
    "faults": "bench.tools.faults:main",
    "priority": "bench.tools.priority:main",
    "native": "bench.inprocess.native:main",
    "llama-native": "bench.inprocess.llama_native:main",
    "structured": "bench.inprocess.structured_output:main",
    "random-llama": "bench.inprocess.random_llama:main",
    "serve": "bench.servers.serve:main",
    "aiperf": "bench.aiperf:main",
    "prompt-cache": "bench.prompt_cache:main",
    "embeddings": "bench.embeddings:main",
    "responses-cancel": "bench.responses_cancel:main",
    "gpu-check": "bench.gpu_check:main",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    named = bool(argv) and argv[0] in COMMANDS
    module, function = COMMANDS[argv[0] if named else "run"].split(":")
    return getattr(importlib.import_module(module), function)(argv[1:] if named else argv)


if __name__ == "__main__":
    sys.exit(main())
