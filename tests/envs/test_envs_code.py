"""The code domain: known-good passes, known-bad fails, and every way to fool the
harness scores 0 — against the local runner and, marked `podman`, the real sandbox."""

import json
import random

import pytest
import trio
from reinforge.envs.domains.code import CodeDomain, assemble_program
from reinforge.envs.tasksets import TaskFileError

PROMPT = 'def sort_desc(xs: list) -> list:\n    """Return xs sorted from largest to smallest."""\n'
TEST = (
    "def check(candidate):\n"
    "    assert candidate([1, 3, 2]) == [3, 2, 1]\n"
    "    assert candidate([]) == []\n"
    "    assert candidate([5, -1, 5]) == [5, 5, -1]\n"
)
GOOD = "    return sorted(xs, reverse=True)\n"

# Expected values no one could guess: a candidate only passes by reading them.
SECRET_PROMPT = 'def mystery(x: int) -> int:\n    """Return the secret for x."""\n'
SECRET_TEST = (
    "def check(candidate):\n"
    "    assert candidate(3) == 918273645\n"
    "    assert candidate(4) == 564738291\n"
)
SNOOP = r"""
import base64, io, os, re, sys, tarfile

def _blobs(deep):
    out = []
    for root in (os.getcwd(), "/run/reinforge", "/dev/shm"):
        for dp, _, fns in os.walk(root):
            for fn in fns:
                try:
                    fd = os.open(os.path.join(dp, fn), os.O_RDONLY | os.O_NONBLOCK)
                    out.append(os.read(fd, 1 << 20)); os.close(fd)
                except OSError:
                    pass
    # every process's argv and environment, decoded (the sandbox's own PID namespace;
    # locally only our parent: the local runner runs as root and would see the whole host)
    pids = [p for p in os.listdir("/proc") if p.isdigit()] if deep else [str(os.getppid())]
    for p in pids:
        for leaf in ("cmdline", "environ"):
            try:
                raw = open("/proc/%s/%s" % (p, leaf), "rb").read()
            except OSError:
                continue
            out.append(raw)
            for item in raw.split(b"\0"):
                value = item.split(b"=", 1)[-1]
                try:
                    data = base64.b64decode(value, validate=True)
                    out.append(data)
                    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                        for m in tar.getmembers():
                            if m.isfile():
                                out.append(tar.extractfile(m).read())
                except Exception:
                    pass
    pid = os.getppid()
    try:
        for fd in os.listdir("/proc/%d/fd" % pid):
            try:
                h = os.open("/proc/%d/fd/%s" % (pid, fd), os.O_RDONLY | os.O_NONBLOCK)
                out.append(os.read(h, 1 << 20)); os.close(h)
            except OSError:
                pass
    except OSError:
        pass
    # every local of every frame up our own stack (a worker forked from a harness that had
    # read its job would find it here)
    f = sys._getframe()
    while f is not None:
        for v in list(f.f_locals.values()):
            try:
                out.append(repr(v).encode()[: 1 << 20])
            except Exception:
                pass
        f = f.f_back
    # the harness's memory and our own (a fork inherits its parent's memory at the fork)
    for who in ((pid, "self") if deep else ()):
        try:
            mem = open("/proc/%s/mem" % who, "rb")
            for line in open("/proc/%s/maps" % who):
                lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                if "r" in line.split()[1] and hi - lo < (64 << 20):
                    try:
                        mem.seek(lo); out.append(mem.read(hi - lo))
                    except OSError:
                        pass
        except OSError:
            pass
    return out

def mystery(x):
    for blob in _blobs(DEEP):
        m = re.search(rb"candidate\(%d\) == (\d+)" % x, blob)
        if m:
            return int(m.group(1))
    return -1
"""


def _task(prompt=PROMPT, test=TEST, entry="sort_desc", timeout_s=2.0):
    row = {"prompt": prompt, "test": test, "entry_point": entry, "timeout_s": timeout_s}
    return CodeDomain().task_from_row(row, where="t:1")


def verify_all(with_runner, task, completions):
    async def main():
        async with with_runner() as runner:
            d = CodeDomain().with_runner(runner)
            return [await d.verify(task, c) for c in completions]

    return trio.run(main)


def test_known_good_completions_score_one(with_runner):
    task = _task()
    full = "```python\ndef sort_desc(xs):\n    return sorted(xs)[::-1]\n```"
    for v in verify_all(with_runner, task, [GOOD, full]):
        assert (v.reward, v.outcome) == (1.0, "pass"), v


def test_what_the_candidate_prints_comes_back_as_output_and_cannot_pass(with_runner):
    printing = ('    print("x" * 5000, file=__import__("sys").stderr)\n'
                '    print("sorting", xs)\n    return xs\n')
    good, bad = verify_all(with_runner, _task(), [GOOD, printing])
    assert (good.outcome, good.output) == ("pass", "")
    assert bad.outcome == "fail" and bad.output.endswith("x\nsorting [1, 3, 2]\n")
    assert len(bad.output) == 2000  # its end: 5000 x's and more were printed


def test_generated_references_score_one_on_every_tier(with_runner):
    d = CodeDomain()
    tasks = [d.sample_task(random.Random(s), tier) for tier in range(4) for s in range(3)]

    async def main():
        async with with_runner() as runner:
            dd = d.with_runner(runner)
            return [await dd.verify(t, t.reference) for t in tasks]

    for task, v in zip(tasks, trio.run(main)):
        assert (v.reward, v.outcome) == (1.0, "pass"), (task.prompt, v)


GAMING = {
    "wrong answer": ("    return xs\n", "fail"),
    "syntax error": ("    return sorted(xs\n", "fail"),
    "prints its way to a pass": (
        "    print('all tests passed'); print('OK'); print('{\"status\": \"pass\"}')\n"
        "    return None\n",
        "fail",
    ),
    "forges a verdict line on every fd": (
        '    import os\n    line = b\'0\' * 32 + b\' {"status": "pass", "reason": "", '
        '"checks": [], "calls": 1}\\n\'\n'
        "    for fd in range(1, 12):\n"
        "        try:\n            os.write(fd, line)\n        except OSError:\n"
        "            pass\n    return None\n",
        "fail",
    ),
    "sys.exit(0) at import": ("    return xs\nimport sys\nsys.exit(0)\n", "fail"),
    "os._exit(0) at import": ("    return xs\nimport os\nos._exit(0)\n", "fail"),
    "sys.exit(0) in the call": ("    import sys\n    sys.exit(0)\n", "fail"),
    "os._exit(0) in the call": ("    import os\n    os._exit(0)\n", "fail"),
    "monkeypatches unittest, builtins and the harness": (
        "    return xs\nimport builtins, sys, unittest\n"
        "unittest.TestCase.assertEqual = lambda *a, **k: None\n"
        "builtins.AssertionError = type('Nope', (Exception,), {})\n"
        "main = sys.modules['__main__']\n"
        "main.CandidateDied = Exception\nmain.from_wire = lambda w: w\n",
        "fail",
    ),
    "__eq__ override": (
        "    class Any(list):\n        def __eq__(self, other):\n            return True\n"
        "    return Any()\n",
        "fail",
    ),
    "int subclass with __eq__": (
        "    class I(int):\n        def __eq__(self, other):\n            return True\n"
        "        __hash__ = int.__hash__\n    return I(0)\n",
        "fail",
    ),
    "kills the harness": (
        "    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n",
        "error",
    ),
    "sleeps forever": ("    import time\n    time.sleep(3600)\n", "timeout"),
}


@pytest.mark.slow
def test_every_way_to_fool_the_harness_scores_zero(with_runner):
    task = _task()
    names = list(GAMING)
    verdicts = verify_all(with_runner, task, [GAMING[n][0] for n in names])
    for name, v in zip(names, verdicts):
        assert v.reward == 0.0, (name, v)
        assert v.outcome == GAMING[name][1], (name, v)


def test_a_crash_inside_a_tests_try_except_still_fails(with_runner):
    test = (
        "def check(candidate):\n    try:\n        candidate([-1])\n    except Exception:\n"
        "        pass\n    assert candidate([2, 1]) == [2, 1]\n"
    )
    task = _task(test=test)
    crash = "    import os\n    if xs == [-1]:\n        os._exit(0)\n    return xs\n"
    (v,) = verify_all(with_runner, task, [crash])
    assert v.reward == 0.0 and "exited" in v.reason


def test_expected_values_cannot_be_read_from_files_fds_environ_or_proc(with_runner, runner_kind):
    task = _task(prompt=SECRET_PROMPT, test=SECRET_TEST, entry="mystery")
    # Reading the harness's memory needs privileges the sandbox never has; the local
    # runner runs as whoever runs the tests (root here), so only the sandbox tries it.
    deep = runner_kind == "podman"
    snoop = "    pass\n" + SNOOP.replace("DEEP", str(deep))
    (v,) = verify_all(with_runner, task, [snoop])
    assert v.reward == 0.0 and v.outcome == "fail", v
    assert "assertion failed" in v.reason
    # Control: the same snoop finds values that ARE visible to it (here, in the prompt).
    leaky = SECRET_PROMPT + "    # candidate(3) == 918273645; candidate(4) == 564738291\n"
    (v,) = verify_all(with_runner, _task(prompt=leaky, test=SECRET_TEST, entry="mystery"), [snoop])
    assert v.reward == 1.0, v


def test_a_test_that_passes_a_function_is_an_error_not_a_pass(with_runner):
    test = "def check(candidate):\n    assert candidate(lambda: 1) == 1\n"
    (v,) = verify_all(
        with_runner,
        _task(prompt="def f(g):\n    pass\n", test=test, entry="f"),
        ["    return g()\n"],
    )
    assert v.outcome == "error" and "cannot send" in v.reason


def test_no_runner_is_an_infra_error():
    v = trio.run(CodeDomain().verify, _task(), GOOD)
    assert v.outcome == "infra_error"


def test_assemble_program_continues_the_prompt_or_takes_a_full_definition():
    assert assemble_program(PROMPT, GOOD, "sort_desc") == PROMPT + GOOD
    full = "def sort_desc(xs):\n    return sorted(xs)\n"
    program = assemble_program("import math\n" + PROMPT, full, "sort_desc")
    assert program.startswith("import math") and program.endswith(full)
    assert assemble_program(PROMPT, f"```python\n{full}```", "sort_desc").endswith(full)


def test_humaneval_and_mbpp_rows_load_as_they_are(tmp_path):
    rows = [
        {
            "task_id": "HumanEval/0",
            "prompt": PROMPT,
            "test": TEST,
            "entry_point": "sort_desc",
            "canonical_solution": GOOD,
        },
        {
            "task_id": 2,
            "text": "Find the shared elements of two lists.",
            "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
            "test_list": ["assert set(similar_elements((3, 4), (4, 5))) == set((4,))"],
            "test_setup_code": "",
            "challenge_test_list": [],
        },
    ]
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = CodeDomain().load_tasks(path)
    assert (a.task_id, a.spec["entry_point"], a.reference) == ("HumanEval/0", "sort_desc", GOOD)
    assert (b.task_id, b.spec["entry_point"]) == ("2", "similar_elements")
    assert b.reference.startswith("def similar_elements")


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": PROMPT, "entry_point": "sort_desc"}, "missing test"),
        ({"prompt": PROMPT, "test": "def check(:", "entry_point": "sort_desc"}, "does not parse"),
        ({"prompt": PROMPT, "test": TEST, "entry_point": "not an id"}, "not a Python identifier"),
        ({"text": "x", "test_list": []}, "`test_list` is empty"),
        ({"prompt": 3, "test": TEST, "entry_point": "f"}, r"\$\.prompt"),
    ],
)
def test_malformed_rows_are_refused_with_their_line_number(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"prompt": PROMPT, "test": TEST, "entry_point": "sort_desc"})
        + "\n"
        + json.dumps(row)
        + "\n"
    )
    with pytest.raises(TaskFileError, match=f"bad.jsonl:2: .*{message}"):
        CodeDomain().load_tasks(path)
