"""``kvpolicy compare``: every policy at every budget on real text and a real model, one report.

With no arguments it loads the embedded SmolLM2-135M-Instruct (``kvpolicy_tools.models.load``), reads
real text shipped in installed packages (nothing is downloaded, ``../shared/data`` is not read)
and compares the full cache, the local window, StreamingLLM, H2O, BUZZ and BUZZ with log n at
budgets of 10, 20, 30 and 50% on three tasks:

* ``ppl``: perplexity of 8 Wikipedia articles (gensim's test dump): 448 tokens prefilled, then 24
  tokens per article fed one at a time through the evicting cache, each next-token prediction scored;
* ``summ``: 2 ACLSum papers cut to 512-token prompts, 32 greedy tokens, ROUGE-1/2/L and their
  geometric mean;
* ``needle``: the San Francisco needle at depths 10/50/90% of a 1024-token Paul Graham haystack,
  key-word recall;
* ``stream`` (short version): 4 of the same articles, 32 tokens prefilled, then 128 tokens fed one at
  a time and scored, at a cache size of 50 tokens, equal mean (``--equalise both`` adds equal capacity).
  ``--tasks stream`` runs the paper's protocol in full: 16 documents, 32 + 1,024 tokens each, cache
  sizes 50 and 100 and the ``--budgets``, both equalisations, BUZZ also at T/w 2.5.

``--data-dir DIR`` switches to the paper's data (wikitext-2, XSum, 10-document NQ QA, KV
retrieval) and enables the paper-only tasks (``qa``, ``kv``, ``tw``; ``stream`` reads wikitext-2). See ``kvpolicy compare
--help`` and ``docs/results.md``.

How a cell is measured: each prompt is prefilled once with a recording cache (full attention,
accumulated attention scores captured), and every configuration starts from a copy of that
prefill on which its policy evicts exactly as it would after its own prefill (the prefill's
computation does not depend on the policy; BUZZ with log n re-runs it for prompts longer than its
log base, where log n changes the prefill). Then the decode steps run through an
:class:`~kvpolicy.hf.EvictingCache`. Budgets are *realised*: the average number of keys each
decode step attended to over what the full cache would have held at the same steps.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpolicy import __version__
from kvpolicy.registry import get_policy, normalize_name
from kvpolicy_tools.command import check_output_folder, run_command

from . import report
from .results import TaskResult
from .tasks import DEFAULT_TASKS, PAPER_TASKS, DataSources, Task, TaskOptions, TokenizerAdapter, make_tasks, parse_floats, split_csv, task_registry
from .tasks.base import PAPER_FILES

__all__ = ["add_arguments", "run", "main", "task_names", "task_options", "DEFAULT_POLICIES", "DEFAULT_BUDGETS", "MEASURED_DEFAULT"]

DEFAULT_POLICIES = ("full", "local", "streaming_llm", "h2o", "tova", "scissorhands", "snapkv_h2o", "pyramid_h2o", "buzz",
                    "buzz_logn")
DEFAULT_BUDGETS = (0.1, 0.3, 0.5)
#: Wall time of the default run as measured (see the README / docs/results.md).
MEASURED_DEFAULT = ("measured: 5.7 minutes wall, 5.7 minutes of CPU time (float32, 1 thread) on a shared 2-core CPU "
                    "at load 0.7-1, 10 policies at 3 budgets; busier sittings take longer")



# =========================================================================== argument parsing
def _per_task(text: str | None, flag: str) -> dict[str, int]:
    """``"4"`` (every task) or ``"ppl=8,summ=4"`` (per task; ``*=N`` for the rest); a name that is
    not a registered task (a misspelling would otherwise be ignored) or an empty value is an error
    naming ``flag``."""
    if text is None:
        return {}
    if not split_csv(text):
        raise ValueError(f"{flag} is empty: give N or TASK=N[,TASK=N...], or leave {flag} out for each task's default")
    out: dict[str, int] = {}
    known = task_registry()
    for item in split_csv(text):
        key, sep, value = item.partition("=")
        if not sep:
            key, value = "*", key
        elif key.strip().lower() not in known and key.strip() != "*":
            raise ValueError(f"{flag}: {key.strip()!r} in {text!r} is not a task; tasks: {', '.join(known)} (or * for the rest)")
        try:
            out[key.strip().lower()] = int(value)
        except ValueError:
            raise ValueError(f"{flag} expects N or TASK=N[,TASK=N...], got {text!r}") from None
        if out[key.strip().lower()] < 1:
            raise ValueError(f"{flag} values must be >= 1, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``compare`` verb's flags."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    registry = task_registry()  # the built-in tasks and those of the kvpolicy.tasks entry points
    p.description = (
        "Compare KV-cache eviction policies on real text with a real model and write a report.\n\n"
        "With no arguments: the embedded SmolLM2-135M-Instruct and text shipped in installed packages (no\n"
        "download, no ../shared/data), policies full, local, streaming_llm, h2o, tova, scissorhands, snapkv_h2o,\n"
        "pyramid_h2o, "
        "buzz, buzz_logn at budgets 10/30/50%, tasks ppl (8 Wikipedia articles: 448 tokens prefilled, 24 scored token by token), summ\n"
        "(2 ACLSum papers cut to 512 tokens, 32 new tokens, ROUGE), needle (depths 10/50/90% of a 1024-token\n"
        "haystack) and a short stream (4 articles: 32 tokens prefilled, 128 streamed and scored, cache size 50,\n"
        f"equal mean); {MEASURED_DEFAULT}.\n\n"
        "Budgets are realised budgets: the average cache size each decode step attended to over the full\n"
        "cache's at the same steps (the BUZZ paper's definition), measured in the run and shown next to the\n"
        "requested one. Decoding is greedy, the chat template is used when the tokenizer has one, seeds are fixed.\n\n"
        "tasks:\n" + "\n".join(f"  {k:8s}{cls.help}" for k, cls in registry.items())
    )
    g = p.add_argument_group("what to compare")
    g.add_argument("--model", default="smollm2-135m",
                   help="model: 'smollm2-135m' (embedded, default), a local Hugging Face model directory, a .gguf "
                   "file, or a hub name such as HuggingFaceTB/SmolLM2-135M-Instruct (Llama-family decoders)")
    g.add_argument("--tasks", default=None,
                   help=f"comma-separated tasks from {', '.join(registry)}; 'default' = {','.join(DEFAULT_TASKS)} "
                   f"(the default), 'paper' = {','.join(PAPER_TASKS)}, 'all'")
    g.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated registered policy names (see `kvpolicy policies`); 'full' is the "
                   "reference line of the plots (default: %(default)s)")
    g.add_argument("--budgets", default=None,
                   help="requested cache budgets in (0, 1) (the share of the cache kept), comma-separated, or 'none' "
                   f"(default: {','.join(f'{b:g}' for b in DEFAULT_BUDGETS)}); each policy's parameters are planned per "
                   "prompt length so its realised budget is closest")
    g.add_argument("--compression-ratios", default=None,
                   help="the budgets as kvpress reports them: compression ratios in (0, 1), the share of the cache "
                   "removed, comma-separated; ratio r runs budget 1 - r (0.25,0.5,0.75 = --budgets 0.75,0.5,0.25); "
                   "not with --budgets")
    g = p.add_argument_group("sizes (N, or TASK=N[,TASK=N...] per task)")
    # each task's own defaults, read from the registered tasks (a plug-in's included)
    samples = ", ".join(f"{name}={cls.default_samples}" for name, cls in registry.items())
    new_tokens = ", ".join(f"{name}={cls.default_max_new_tokens}" for name, cls in registry.items() if cls.kind == "gen")
    g.add_argument("--samples", default=None,
                   help=f"samples per task (default: {samples}; needle/passkey: haystacks per length x depth cell, qa: "
                   "questions, each at every gold position; the default run's short stream: 4)")
    g.add_argument("--max-new-tokens", default=None,
                   help=f"greedy tokens generated per prompt (default: {new_tokens})")
    g.add_argument("--context", default=None,
                   help="prompt tokens: ppl = tokens prefilled before scoring (default 448), summ/tw with embedded "
                   "data = exact prompt length (default 512); with --data-dir the longest prompt kept (longer "
                   "XSum articles are cut, longer QA prompts skipped; default: no limit)")
    g = p.add_argument_group("each task's own settings")
    for cls in registry.values():
        if "add_arguments" in vars(cls):  # a subclass shares its parent's flags
            cls.add_arguments(g)

    g = p.add_argument_group("data, hardware, output")
    g.add_argument("--data-dir", default=None,
                   help="folder with the paper's files (wikitext-2-raw-test.txt, xsum_0shot.jsonl, "
                   "nq-open-oracle.jsonl.gz, kv-retrieval-75_keys.jsonl.gz): ppl reads wikitext-2, summ/tw read "
                   "XSum, qa/kv become available; 'hub' uses the Hugging Face datasets loaders (needs network and "
                   "the datasets package). Default: embedded text from installed packages")
    g.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:1, ...")
    g.add_argument("--dtype", default="auto",
                   help="float32, bfloat16 or float16; auto (default) = float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--threads", default="auto",
                   help="torch CPU threads; auto (default) = 1 on machines with 2 cores or fewer (on a shared "
                   "2-core machine two threads were ~10x slower than one), else torch's default")
    g.add_argument("--batch-size", type=int, default=8,
                   help="prompts of equal length decoded together (default %(default)s)")
    g.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                   help="wrap prompts in the tokenizer's chat template: auto (default: when it has one), on, off")
    g.add_argument("--out", default="kvpolicy-report", help="report folder (default ./%(default)s)")
    g.add_argument("--seed", type=int, default=0,
                   help="sample selection (0 = file order, else a seeded shuffle) and torch seed (default 0)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _budgets(args: argparse.Namespace) -> list[float]:
    """The requested budgets: ``--budgets``, or ``1 - r`` for each of ``--compression-ratios``."""
    ratios = getattr(args, "compression_ratios", None)
    if ratios is not None and args.budgets is not None:
        raise ValueError("--budgets and --compression-ratios are two spellings of the same setting: give one")
    if ratios is not None:
        values = parse_floats(ratios, "--compression-ratios")
        if not values:  # (an empty value ran no policy at all, and exited 0)
            raise ValueError(f"--compression-ratios {ratios!r} names no ratio: give ratios in (0, 1), e.g. 0.25,0.5,0.75 "
                             "(--budgets none runs no budget)")
        for r in values:
            if not 0.0 < r < 1.0:
                raise ValueError(f"--compression-ratios must lie in (0, 1), got {r:g} (ratio 0 is the policy 'full')")
        return [round(1.0 - r, 12) for r in values]
    if args.budgets is not None and not str(args.budgets).strip():
        raise ValueError("--budgets '' is empty: give budgets in (0, 1), e.g. 0.1,0.3, or 'none' for no budget")
    budgets = parse_floats(args.budgets, "--budgets") if args.budgets is not None else list(DEFAULT_BUDGETS)
    for b in budgets:
        if not 0.0 < b < 1.0:
            raise ValueError(f"--budgets must lie in (0, 1), got {b:g} (the full cache is the policy 'full')")
    return budgets


def task_names(text: str | None) -> list[str]:
    """The tasks ``--tasks text`` names, in order and without repeats: a comma-separated list of
    task names and the groups ``default`` (also ``None``), ``paper`` (the paper's tasks) and
    ``all`` (every registered task).

    Example:
        >>> task_names(None)
        ['ppl', 'summ', 'needle', 'stream']
        >>> task_names("stream,paper")
        ['stream', 'ppl', 'summ', 'qa', 'needle', 'kv', 'tw']
    """
    if text is None or text.strip().lower() == "default":
        return list(DEFAULT_TASKS)
    names: list[str] = []
    for t in split_csv(text):
        key = t.lower()
        expand = {"paper": list(PAPER_TASKS), "all": list(task_registry()), "default": list(DEFAULT_TASKS)}.get(key, [key])
        names += [n for n in expand if n not in names]
    if not names:  # an empty report and exit 0 read as "every task passed"
        raise ValueError(f"--tasks names no task ({text!r}); leave it out for the default set, or name tasks: "
                         f"{', '.join(task_registry())}")
    return names


def _policy_names(text: str) -> list[str]:
    if text.strip().lower() == "all":
        return list(DEFAULT_POLICIES)
    names = []
    for t in split_csv(text):
        get_policy(t)  # ValueError listing the known names
        n = normalize_name(t)
        if n not in names:
            names.append(n)
    if not names:
        raise ValueError("--policies is empty")
    return names


def task_options(args: argparse.Namespace, task: str) -> TaskOptions:
    """The options every task shares (samples, new tokens, context, seed) for ``task``, from the
    parsed ``kvpolicy compare`` arguments: a per-task value (``--samples needle=4``) wins over the
    value for all tasks; a task's own options come from its ``options_from_args``.

    Example:
        >>> args = build_parser().parse_args(["--samples", "needle=4,*=8", "--seed", "3"])
        >>> task_options(args, "needle"), task_options(args, "ppl").samples
        (TaskOptions(samples=4, max_new_tokens=None, context=None, seed=3), 8)
    """
    def pick(table: dict[str, int]) -> int | None:
        return table.get(task, table.get("*"))

    return TaskOptions(
        samples=pick(_per_task(args.samples, "--samples")),
        max_new_tokens=pick(_per_task(args.max_new_tokens, "--max-new-tokens")),
        context=pick(_per_task(args.context, "--context")),
        seed=args.seed,
    )


# =========================================================================== commands
def _command(args: argparse.Namespace, task: Task, policies: Sequence[str], budgets: Sequence[float] | None,
             *, cache_sizes: Sequence[int] | None = None, flags: Sequence[str] | None = None) -> str:
    """The ``kvpolicy compare`` command line that reruns ``task`` with these policies, budgets
    (``None``: no ``--budgets``) and cache sizes; ``flags``: the task's own flags (default: its
    :meth:`~kvpolicy_tools.eval.tasks.Task.cli_flags`)."""
    parts = ["kvpolicy", "compare"]
    if args.model != "smollm2-135m":
        parts += ["--model", args.model]
    parts += ["--tasks", task.name, "--policies", ",".join(policies)]
    if budgets is not None:
        parts += ["--budgets", ",".join(f"{b:g}" for b in budgets) if budgets else "none"]
    if cache_sizes:
        parts += ["--cache-sizes", ",".join(str(s) for s in cache_sizes)]
    parts += ["--samples", str(task.n_samples)]
    parts += task.run_flags(cache_sizes)
    for f in task.cli_flags() if flags is None else flags:
        parts += shlex.split(f)
    if args.data_dir:
        parts += ["--data-dir", str(args.data_dir)]
    if args.device != "cpu":
        parts += ["--device", args.device]
    if args.dtype != "auto":
        parts += ["--dtype", args.dtype]
    if args.chat != "auto":
        parts += ["--chat", args.chat]
    if args.seed:
        parts += ["--seed", str(args.seed)]
    return shlex.join(parts)


def _attach_commands(args: argparse.Namespace, tasks: Sequence[Task], results: dict[str, TaskResult],
                     policies: Sequence[str], budgets: Sequence[float]) -> None:
    """The command behind each task and each cell (what they hold: the task's command hooks)."""
    for task in tasks:
        res = results[task.name]
        res.command = _command(args, task, policies, task.command_budgets(budgets), cache_sizes=task.command_cache_sizes())

        def command(policies: Sequence[str], budgets: Sequence[float] | None, *, cache_sizes: Sequence[int] | None = None,
                    flags: Sequence[str] | None = None, task: Task = task) -> str:
            return _command(args, task, policies, budgets, cache_sizes=cache_sizes, flags=flags)

        for cell in res.cells:
            cell.command = task.cell_command(cell, command)


# =========================================================================== run
def _threads(spec: str) -> int | None:
    if spec == "auto":
        return 1 if (os.cpu_count() or 1) <= 2 else None
    try:
        n = int(spec)
    except ValueError:
        raise ValueError(f"--threads expects a positive integer or 'auto', got {spec!r}") from None
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    return n


def run(args: argparse.Namespace, *, model: Any = None, tokenizer: Any = None, sources: DataSources | None = None) -> int:
    """Run ``kvpolicy compare``. ``model``/``tokenizer``/``sources`` let Python callers (and the
    tests) pass a model and in-memory data instead of ``--model`` / ``--data-dir``."""
    started = time.perf_counter()
    # here, not at the top: the hf extra (torch, transformers), which `kvpolicy policies` runs without
    # (every verb's parser imports this module)
    import torch

    from .. import models
    from . import engine

    models.check_device(args.device, "--device")
    check_output_folder(Path(args.out), "--out")
    threads = _threads(str(args.threads))
    if threads is not None and torch.device(args.device).type == "cpu":
        torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    policies = _policy_names(args.policies)
    budgets = _budgets(args)
    if args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    names = task_names(args.tasks)
    # the default run (no --tasks, or 'default' among them): a task may run a short version of
    # itself there (the stream does; --tasks stream runs the full protocol)
    args.default_run = args.tasks is None or "default" in [t.lower() for t in split_csv(args.tasks)]
    if sources is None:
        if args.data_dir and args.data_dir.lower() != "hub":
            if not Path(args.data_dir).is_dir():
                raise ValueError(f"--data-dir {args.data_dir}: no such folder")
            if not any((Path(args.data_dir) / name).is_file() for name in PAPER_FILES):
                raise ValueError(
                    f"--data-dir {args.data_dir} holds none of the paper's files ({', '.join(PAPER_FILES)}): point it at "
                    "the folder that has them (see the shared data README), or leave --data-dir out for the embedded text"
                )
        sources = DataSources(data_dir=args.data_dir)  # qa's --qa-distractors is its own option
    registry = task_registry()
    tasks = make_tasks(names, TaskOptions(), sources,
                       {n: registry[n].options_from_args(args) for n in names if n in registry})
    tasks = [type(t)(task_options(args, t.name), sources, t.options) for t in tasks]
    for t in tasks:
        t.check(policies, budgets)

    out_dir = Path(args.out)
    if model is None:
        print(f"[kvpolicy] loading {args.model} ({args.device}, dtype {args.dtype})", file=sys.stderr, flush=True)
        model, tokenizer = models.load(args.model, device=args.device, dtype=None if args.dtype == "auto" else args.dtype)
    if tokenizer is None:
        raise ValueError("a tokenizer is needed with a model object")
    tok = TokenizerAdapter(tokenizer, chat={"auto": None, "on": True, "off": False}[args.chat])

    results = engine.evaluate(model, tok, tasks, policies, budgets, batch_size=args.batch_size, progress=not args.no_progress)
    _attach_commands(args, tasks, results, policies, budgets)
    wall = time.perf_counter() - started
    meta = _meta(args, engine.environment(model), tok, policies, budgets, wall)
    doc = report.document(meta, results)
    paths = report.write_report(doc, out_dir)
    print(report.console_summary(doc))
    print(f"\nreport: {paths['report']}\nresults: {paths['results']}\nplots: {', '.join(str(p) for p in paths['plots'])}")
    print(f"wall time {wall / 60:.1f} min")
    return 0


def _meta(args: argparse.Namespace, env: dict[str, Any], tok: TokenizerAdapter, policies: Sequence[str], budgets: Sequence[float],
          wall: float) -> dict[str, Any]:
    """The report's run section: the command, its arguments and what it ran on (``env``, from
    :func:`kvpolicy_tools.eval.engine.environment`)."""
    argv = getattr(args, "argv", None)
    if argv is None and "compare" in sys.argv[1:]:
        argv = sys.argv[sys.argv.index("compare") + 1 :]
    return {
        "kvpolicy": __version__,
        "model": args.model,
        "model_info": env["model_info"],
        "chat_template": tok.chat,
        "device": env["device"],
        "dtype": env["dtype"],
        "threads": env["threads"],
        "torch": env["torch"],
        "transformers": env["transformers"],
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "policies": list(policies),
        "budgets": list(budgets),
        "data_dir": args.data_dir,
        "seed": args.seed,
        "command": "kvpolicy compare" + (" " + shlex.join(argv) if argv else ""),
        "wall_seconds": wall,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpolicy compare")
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvpolicy_tools.eval.compare``: the same as ``kvpolicy compare``."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # recorded in the report's run section

    return run_command("kvpolicy compare", run, args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

