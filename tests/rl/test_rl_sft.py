"""`reinforge sft`: demonstrations, response-only loss, determinism, caching, the CLI."""

import json
import subprocess
import sys

import pytest
import torch
from reinforge.rl import checkpoint as ckpt
from reinforge.rl.sft import (
    Demo,
    SFTConfig,
    demos_from_domains,
    demos_from_jsonl,
    encode_demo,
    run_sft,
)


def cfg(model, out, **kw):
    base = {"model": str(model), "out": str(out), "steps": 4, "batch_size": 4,
            "num_examples": 8, "torch_threads": 1, "learning_rate": 3e-3}
    base.update(kw)
    return SFTConfig(**base)


def test_domain_demonstrations_are_seeded_references():
    a = demos_from_domains(("math", "code"), (0, 1), 6, seed=3)
    assert a == demos_from_domains(("math", "code"), (0, 1), 6, seed=3)
    assert a != demos_from_domains(("math", "code"), (0, 1), 6, seed=4)
    assert len(a) == 6 and all(d.response for d in a)
    assert a[0].response.endswith(a[0].response.split("#### ")[-1])  # math ends with its answer
    with pytest.raises(ValueError, match="unknown domain 'nope'"):
        demos_from_domains(("nope",), (0,), 1, seed=0)


def test_demonstrations_leave_out_the_tasks_of_the_held_out_sets():
    from reinforge.envs.domain import DomainRegistry
    from reinforge.rl.evalsets import HeldOutConfig, build_heldout, fingerprint

    # math's tier 0 has 100 distinct problems: 384 draws would meet nearly all of them.
    heldout = HeldOutConfig(tasks_per_tier=20, tiers=[0])
    held = {fingerprint(t.prompt)
            for t in build_heldout(DomainRegistry.default(), ["math"], heldout)["math"]}
    assert len(held) == 20
    free = demos_from_domains(("math",), (0,), 384, seed=0)
    kept = demos_from_domains(("math",), (0,), 384, seed=0, heldout=heldout)
    assert len(held & {fingerprint(d.prompt) for d in free}) >= 15
    assert len(kept) == 384 and not held & {fingerprint(d.prompt) for d in kept}


def test_a_tier_whose_tasks_are_all_held_out_is_left_out_of_the_demonstrations(tmp_path):
    # A held-out file with every prompt terminal's tier 1 can give: a warm start over tiers
    # 0-2 (a pretrained model's) shows tiers 0 and 2; tier 1 alone has nothing to show.
    import random

    import msgspec
    from reinforge.envs.domain import DomainRegistry
    from reinforge.envs.domains.terminal import TerminalSpec
    from reinforge.rl.evalsets import HeldOutConfig, build_heldout, fingerprint

    terminal = DomainRegistry.default().get("terminal")
    rows = {}
    for seed in range(3000):
        task = terminal.sample_task(random.Random(seed), 1)
        spec = msgspec.convert(task.spec, TerminalSpec)
        rows[task.prompt] = {"instruction": spec.instruction, "files": spec.files,
                             "checks": msgspec.to_builtins(spec.checks), "tier": 1}
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
    heldout = HeldOutConfig(files={"terminal": str(path)})
    held = {fingerprint(t.prompt)
            for t in build_heldout(DomainRegistry.default(), ["terminal"], heldout)["terminal"]}
    assert held == {fingerprint(p) for p in rows}
    demos = demos_from_domains(("terminal",), (0, 1, 2), 48, seed=0, heldout=heldout)
    shown = {fingerprint(d.prompt) for d in demos}
    assert len(demos) == 48 and not shown & held
    assert any("has a bug" in d.prompt for d in demos)  # tier 2
    with pytest.raises(ValueError, match="'terminal' gives no reference completions outside"):
        demos_from_domains(("terminal",), (1,), 4, seed=0, heldout=heldout)


def test_a_bad_jsonl_row_is_refused_with_its_line_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: not a \{prompt, response\} row"):
        demos_from_jsonl(path)
    path.write_text('{"prompt": "a", "response": "b"}\n')
    assert demos_from_jsonl(path) == [Demo("a", "b")]


def test_sft_is_deterministic_cached_and_learns_the_demonstrations(tiny_model_dir, tmp_path):
    first = run_sft(cfg(tiny_model_dir, tmp_path / "a", steps=12))
    second = run_sft(cfg(tiny_model_dir, tmp_path / "b", steps=12))
    assert not first["cached"] and not second["cached"]
    assert first["input_hash"] == second["input_hash"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "model.safetensors").read_bytes()
    assert first["loss_last10_mean"] < first["loss_first"]
    again = run_sft(cfg(tiny_model_dir, tmp_path / "a", steps=12))
    assert again["cached"] and again["loss_last"] == first["loss_last"]
    # The thread count decides how fast, not what is trained: the start is reused.
    assert run_sft(cfg(tiny_model_dir, tmp_path / "a", steps=12, torch_threads=2))["cached"]
    changed = run_sft(cfg(tiny_model_dir, tmp_path / "a", steps=3))
    assert not changed["cached"] and changed["input_hash"] != first["input_hash"]
    assert ckpt.read_manifest(tmp_path / "a").extra["input_hash"] == changed["input_hash"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"), dtype=torch.float32)


def test_the_loss_counts_response_tokens_only(tiny_model_dir, tmp_path):
    # identical responses after wildly different prompts: a response-only loss lets the
    # model drive the loss near zero quickly; the prompts themselves are unlearnable noise
    rows = [{"prompt": f"noise {i * 7919 % 1000} {i * 104729 % 977}", "response": "#### 7"}
            for i in range(16)]
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_sft(cfg(tiny_model_dir, tmp_path / "o", jsonl=str(path), steps=30,
                      batch_size=8, learning_rate=1e-2))
    assert res["examples"] == 16
    assert res["loss_last10_mean"] < 0.1 < res["loss_first"]


def test_the_sft_command_prints_a_final_json_line(tiny_model_dir, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "reinforge", "sft", "--model", str(tiny_model_dir), "--out",
         str(out), "--steps", "2", "--examples", "4", "--batch-size", "2", "--threads", "1"],
        capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["out"] == str(out) and result["steps"] == 2 and not result["cached"]
    assert "sft step 2/2" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "reinforge", "sft", "--model", str(tmp_path),
                          "--out", str(out)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert bad.returncode == 2 and "no config.json there" in bad.stderr


def test_sft_builds_a_task_prompt_exactly_as_the_evaluator_and_the_sampler_do(tiny_model_dir):
    from transformers import AutoTokenizer

    from reinforge.actors.evaluator import ServerSource
    from reinforge.rl.prompts import task_prompt_ids

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert tok.chat_template  # the tiny policy has one: the formats could differ
    prompt = "What is 2 + 3?"
    ids, mask = encode_demo(tok, Demo(prompt=prompt, response="5"))
    n_prompt = mask.index(1)
    assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)
    evaluator = ServerSource(None, tok, max_new_tokens=8, temperature=0.0)
    sampled = task_prompt_ids(tok, prompt)  # what the sampler sends (its test checks that)
    assert ids[:n_prompt] == evaluator.prompt_ids(prompt) == sampled
    assert "<|im_start|>assistant" in tok.decode(ids[:n_prompt])
    assert ids[n_prompt:] == tok.encode("5", add_special_tokens=False) + [tok.eos_token_id]
