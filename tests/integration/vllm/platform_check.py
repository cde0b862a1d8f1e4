#!/usr/bin/env python3
"""laprox.vllm on a platform other than vLLM's CPU backend (the CUDA build, say) stays off and
says so once: none of vLLM's functions is wrapped, one warning names the platform.

    platform_check.py          (in the vLLM venv; no engine is started)
"""

import logging
import sys


def main() -> int:
    from vllm.platforms import current_platform
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.worker import gpu_model_runner

    from laprox.vllm import _runner

    warnings = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("laprox.vllm").addHandler(Collect())
    def wrapped():  # what install() wraps on the CPU backend (compact mode)
        runner, impl = gpu_model_runner.GPUModelRunner, cpu_attn.CPUAttentionBackendImpl
        return (runner._prepare_inputs, runner._update_states, impl.forward,
                impl.do_kv_cache_update, Scheduler.update_from_output)

    before = wrapped()
    type(current_platform).is_cpu = lambda self: False  # what a CUDA build answers
    _runner.install(_runner.Config(target="unix:/nonexistent"))
    after = wrapped()
    ok = before == after and len(warnings) == 1 and "CPU backend only" in warnings[0]
    print(("ok   " if ok else "FAIL ") + f"not the CPU backend: vLLM's functions "
          f"{'untouched' if before == after else 'WRAPPED'}, warnings {warnings}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
