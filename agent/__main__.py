"""Command line: ``python -m agent demo | run | bfcl | serve``."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

from decoding import (BACKENDS, DEFAULT_BACKEND, DEFAULT_DRAFTER, DEFAULT_MODEL, DEFAULT_NUM_DRAFT_TOKENS, DRAFTERS, KNOWN_MODELS,
                      WINDOWS, drafter_choices)
from schemas import SpecAgentError, Tool


class UserError(SpecAgentError):
    """A mistake in the command line or its inputs: printed as one line, exit status 2 (no traceback)."""


def tool_choice_arg(text: str):
    """``--tool-choice``: ``auto``, ``required``, ``none`` or a JSON object naming a tool, ``{"name": "x"}``."""
    if text in ("auto", "required", "none"):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    name = value.get("name") or (value.get("function") or {}).get("name") if isinstance(value, dict) else None
    if not isinstance(name, str):
        raise argparse.ArgumentTypeError(f"{text!r}: use auto, required, none or a JSON object naming a tool, "
                                         f"e.g. '{{\"name\": \"get_weather\"}}'")
    return {"name": name}


def _common(p: argparse.ArgumentParser) -> None:
    from .formats import FORMATS  # read when the parser is built: a new row of the table is a new choice

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"alias ({', '.join(KNOWN_MODELS)}), HF directory, HF id in the local cache or .gguf path "
                        f"(default: {DEFAULT_MODEL}); on llama.cpp an alias may name its weights: alias:q8_0, "
                        f"alias:q4_0 (re-quantised once, cached) or alias:shipped ({DEFAULT_MODEL} loads as Q8_0)")
    p.add_argument("--tool-format", default=None, choices=tuple(FORMATS),
                   help="tool-call format (default: detected from the chat template)")
    p.add_argument("--chat-template", default=None, help="Jinja chat template file (for a model without one)")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, choices=drafter_choices(),
                   help="auto (default): the drafter the model's MTP head card names (where the backend runs the "
                        "head), else lookup; " + "; ".join(f"{n}: {row.summary}" for n, row in DRAFTERS.items()))
    p.add_argument("--num-draft-tokens", type=_at_least(1), default=DEFAULT_NUM_DRAFT_TOKENS,
                   help="γ, drafter tokens per window")
    p.add_argument("--adaptive", action="store_true", help="adapt γ online from the acceptance rate")
    p.add_argument("--window", default=None, choices=WINDOWS,
                   help="speculative windows: cost (default: a token is drafted only where its verify row pays, by "
                        "the row cost measured on this CPU; llama.cpp) or fixed (γ drafts whenever the drafter has "
                        "them); the output is the same")
    p.add_argument("--draft-model", default=None, help="draft model for --drafter draft_model")
    p.add_argument("--engine", dest="engine", default=None, choices=tuple(BACKENDS), help="the older name of --backend")
    p.add_argument("--backend", dest="backend", default=None, choices=tuple(BACKENDS),
                   help="what runs the model (--engine is an alias; default: llamacpp for a GGUF on the CPU where "
                        "llama-cpp-python is installed, else torch): "
                        + "; ".join(f"{n}: {row.summary}" for n, row in BACKENDS.items()))
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of the llama.cpp backend (default: the physical cores this process may use; "
                        "1 on batch-invariant weights (SmolLM2, the default 0.5B as Q8_0, a Qwen alias:q8_0; not "
                        "alias:shipped) is the identity configuration: bit-identical verify rows, so greedy "
                        "speculative output equals one token per forward; more threads are faster but may flip "
                        "near-ties)")
    p.add_argument("--ctx-size", "-c", type=_at_least(1), default=None,
                   help="llama.cpp backend: KV cache positions per sequence, prompt + output (default 8192, capped by "
                        "the model's training context), as llama.cpp's -c")
    p.add_argument("--device", default="cpu", help="torch backend: cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", help="torch backend: float32, bfloat16, float16")
    p.add_argument("--max-new-tokens", type=_at_least(1), default=256)
    p.add_argument("--no-grounding", dest="grounding", action="store_false",
                   help="return calls as decoded: keep optional arguments the conversation does not write, and "
                        "never decode a turn again whose calls take nothing from it, nor add calls for the items "
                        "of a written list (agent/grounding.py, agent/parallel_calls.py)")
    p.add_argument("--no-close-at-model-end", dest="close_at_model_end", action="store_false",
                   help="where the model asks to end inside a call it is writing, keep it writing (the grammar masks "
                        "its end) instead of closing the call there (EngineConfig.close_at_model_end)")
    p.add_argument("--no-tool-prior", dest="tool_prior", action="store_false",
                   help="keep the tool the decode chose instead of choosing it against the model's prior for the "
                        "tools listed (agent/tool_prior.py, EngineConfig.tool_prior)")


def _agent(args, tools, **kwargs):
    from agent import Agent

    return Agent(args.model, tools, drafter=args.drafter, num_draft_tokens=args.num_draft_tokens,
                 adaptive=args.adaptive, draft_model=args.draft_model, device=args.device, dtype=args.dtype,
                 tool_format=args.tool_format, chat_template=args.chat_template, **_backend_args(args), **kwargs)


def _backend_args(args) -> dict:
    """``backend``/``threads`` keyword arguments (None where the user kept the default; a drafter that needs what
    the default backend lacks picks a backend that has it)."""
    if args.backend and args.engine and args.backend != args.engine:
        raise UserError(f"--backend {args.backend} and --engine {args.engine} disagree (--engine is the older name "
                        f"of --backend)")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    backend = args.backend or args.engine
    if backend is None and args.drafter in DRAFTERS and not BACKENDS[DEFAULT_BACKEND].supports(
            DRAFTERS[args.drafter].needs):
        backend = "torch"
    if args.ctx_size is not None and args.ctx_size < 2:
        raise UserError(f"--ctx-size must be >= 2, got {args.ctx_size}")
    return {"backend": backend, "threads": args.threads, "ctx_size": args.ctx_size}


def _print_run(prompt: str, res) -> None:
    print(f"\n>>> {prompt}")
    for rec in res.tool_calls:
        print(f"  tool call : {rec.call.name}({json.dumps(rec.call.arguments, ensure_ascii=False)})")
        print(f"  result    : {rec.error if rec.error else json.dumps(rec.result, ensure_ascii=False, default=str)}")
    for c in res.pending_calls:
        print(f"  tool call : {c.name}({json.dumps(c.arguments, ensure_ascii=False)})  [no callable: returned]")
    if res.truncated and res.final_answer is None:
        print("  (tool call cut at --max-new-tokens: not returned)")
    elif res.truncated:
        print("  (answer cut at --max-new-tokens)")
    if res.stop_reason == "max_steps":
        print(f"  (stopped: {res.steps} steps ran out before an answer)")
    elif res.stop_reason == "error":
        print(f"  error     : {res.error}")
    if res.final_answer is not None:
        answer = " ".join(res.final_answer.split())
        print(f"  answer    : {answer[:300]}{' …' if len(answer) > 300 else ''}")
    s = res.stats
    print(f"  stats     : {s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, {s.tokens_per_forward:.2f} tokens/forward, "
          f"{s.target_forwards} target forwards, acceptance {s.acceptance_rate:.2f}, {s.forced} forced tokens; "
          f"prompts {s.prompt_tokens} tokens ({s.prompt_tokens_cached} cached), prefill {s.prefill_seconds:.1f} s")


def _model_line(agent, args, load_s: float) -> str:
    """What runs: the model (its weights), backend and threads, load time, drafter and tools — one line."""
    where = agent.generator.backend.describe(agent.generator.loaded)
    return (f"model: {agent.generator.loaded.name}, {where} ({load_s:.1f} s to load); "
            f"drafter: {_drafter_label(agent.generator, args.drafter)}; tools: {', '.join(agent.registry.names)}")


def cmd_demo(args) -> int:
    from .demo_tools import PROMPTS, TOOLS

    t = time.perf_counter()
    # bounded strings, numbers and lists in the grammar: a 135M model can otherwise run on inside a value
    agent = _agent(args, TOOLS, max_string_length=64, max_decimals=6, max_items=32)
    print(_model_line(agent, args, time.perf_counter() - t))
    for prompt in PROMPTS:
        res = agent.run(prompt, tool_choice=args.tool_choice, max_new_tokens=args.max_new_tokens)
        _print_run(prompt, res)
    return 0


def load_tools(spec: str) -> list:
    """The tools named by ``--tools MODULE:OBJ`` (a list or tuple of tools, a dict whose values are tools, or one
    tool). Raises :class:`UserError` (a module that cannot be imported, raises on import or lacks ``OBJ``)."""
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise UserError(f"--tools {spec!r}: use MODULE:OBJ, e.g. examples.my_tools:TOOLS")
    sys.path.insert(0, ".")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise UserError(f"--tools {spec!r}: cannot import module {mod_name!r} ({e})") from None
    except Exception as e:  # the user's module raised (or does not parse): where, in one line
        tb = traceback.extract_tb(e.__traceback__)
        where = "" if isinstance(e, SyntaxError) or not tb else f" ({tb[-1].filename}, line {tb[-1].lineno})"
        message = " ".join(str(e).split())  # one line (a SyntaxError's names its file and line)
        raise UserError(f"--tools {spec!r}: importing module {mod_name!r} raised {type(e).__name__}: {message}"
                        f"{where}") from None
    if not hasattr(module, attr):
        raise UserError(f"--tools {spec!r}: module {mod_name!r} has no {attr!r}")
    obj = getattr(module, attr)
    if isinstance(obj, dict) and obj and "name" not in obj and "function" not in obj \
            and all(callable(v) or isinstance(v, (dict, Tool)) for v in obj.values()):
        return list(obj.values())  # {"add": add, ...}: its values are the tools
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def cmd_run(args) -> int:
    from schemas import ToolRegistry

    from .tool_choice import filter_tools

    if not args.prompt.strip():
        raise UserError("the prompt is empty: give a question or instruction")
    tools = load_tools(args.tools)
    filter_tools(ToolRegistry(tools), args.tool_choice)  # an unknown tool name fails before the model loads
    t = time.perf_counter()
    agent = _agent(args, tools)
    print(_model_line(agent, args, time.perf_counter() - t), file=sys.stderr)  # stdout: the run's own lines
    res = agent.run(args.prompt, tool_choice=args.tool_choice, max_new_tokens=args.max_new_tokens)
    _print_run(args.prompt, res)
    return 0


def _config(args):
    from .engine import EngineConfig

    return EngineConfig(drafter=args.drafter, num_draft_tokens=args.num_draft_tokens, adaptive=args.adaptive,
                        window=args.window, max_string_length=args.max_string_length, max_decimals=args.max_decimals,
                        max_items=args.max_items, max_new_tokens=args.max_new_tokens, grounding=args.grounding,
                        close_at_model_end=args.close_at_model_end, tool_prior=args.tool_prior)


def _drafter_label(generator, name: str) -> str:
    """``name``, with what ``auto`` resolves to for this model (e.g. ``auto (lookup_mtp)``)."""
    resolved = generator.resolve_drafter(name)
    return name if resolved == name else f"{name} ({resolved})"


def _at_least(minimum: float, kind=int, strictly: bool = False):
    """An argparse type: a number of ``kind`` >= ``minimum`` (> with ``strictly``); argparse names the flag in its
    error (``argument --concurrency: expected …``), before the model loads."""
    def parse(text: str):
        try:
            n = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") \
                from None
        if n != n or n < minimum or (strictly and n == minimum):  # n != n: NaN (every request would time out)
            raise argparse.ArgumentTypeError(f"expected a number {'>' if strictly else '>='} {minimum}, got {text}")
        return n
    parse.__name__ = kind.__name__  # argparse's "invalid int value" wording where the parse fails
    return parse


def _count_or_none(what: str, minimum: int):
    """An argparse type: a count of ``what`` >= ``minimum``, or ``none`` (``--max-decimals``, ``--max-items``)."""
    def parse(text: str) -> int | str:
        if text.lower() == "none":
            return "none"
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a count of {what} or 'none', got {text!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"expected a count of {what} >= {minimum} or 'none', got {n}")
        return n
    return parse


def cmd_bfcl(args) -> int:
    # the benchmark's runner and scorer live in bench/, outside the product packages: imported only here
    from bench.bfcl import CATEGORIES, MAX_ITEMS, MAX_STRING_LENGTH, run_bfcl, summary_table
    from bench.parse_only import RUNTIMES, parse_only_factory

    from .agent import Agent
    from .engine import LocalEngine
    from .formats import ToolFormatError

    if args.max_string_length is None:
        args.max_string_length = MAX_STRING_LENGTH
    if args.max_decimals == "none":  # numbers unbounded (the default, as the Agent's): exponents can be written
        args.max_decimals = None
    if args.max_items is None:
        args.max_items = MAX_ITEMS
    elif args.max_items == "none":  # lists uncapped
        args.max_items = None
    runtimes = args.runtime.split(",")
    if any(r not in RUNTIMES for r in runtimes):
        raise UserError(f"--runtime {args.runtime!r}: choose from {', '.join(RUNTIMES)} (several joined by commas)")
    categories = list(dict.fromkeys(c for name in args.category.split(",")
                                    for c in (CATEGORIES if name == "all" else (name,))))
    if unknown := [c for c in categories if c not in CATEGORIES]:  # before the model loads, not after a category ran
        raise UserError(f"unknown BFCL category {unknown[0]!r}; choose one of {', '.join(CATEGORIES)} or all "
                        f"(several joined by commas)")
    engine = LocalEngine(args.model, draft_model=args.draft_model, device=args.device, dtype=args.dtype,
                         tool_format=args.tool_format, chat_template=args.chat_template, **_backend_args(args))
    config = _config(args).override(count_masked_ends=True)  # cut turns: did the grammar mask the model's end?

    def factory(tools):
        return Agent(engine, tools, config=config, strict=False)

    factories = {"ours": factory}
    if "parse-only" in runtimes:  # free generation + the format's parser, as vLLM's hermes parser (bench/)
        factories["parse-only"] = parse_only_factory(engine, config)
    summaries = []
    for category in categories:
        for runtime in runtimes:
            try:
                summaries.append(run_bfcl(factories[runtime], category, limit=args.limit, data_dir=args.data_dir,
                                          drafter=args.drafter, max_new_tokens=args.max_new_tokens,
                                          split=args.split, out=lambda s: print(s, flush=True), runtime=runtime))
            except (ToolFormatError, FileNotFoundError) as e:
                if len(categories) == 1 and len(runtimes) == 1:
                    raise UserError(f"bfcl {category}: {e}") from None
                summaries.append({"category": category, "split": args.split, "runtime": runtime,
                                  "error": str(e).split(";")[0]})
    if len(categories) > 1 or len(runtimes) > 1:
        print(f"\nmodel {engine.name}, drafter {_drafter_label(engine.generator, args.drafter)}, split {args.split}, "
              f"limit {args.limit}")
        print(summary_table(summaries))
    return 0


def _check_bind(host: str, port: int) -> None:
    """Refuse, before the model loads, an address the server could not listen on (a port out of range, a host
    that does not resolve or is not this machine's, a port in use). Raises :class:`UserError`."""
    import socket

    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind((host, port))
    except OSError as e:
        raise UserError(f"cannot listen on --host {host} --port {port}: {e.strerror or e}") from None


def cmd_serve(args) -> int:
    from .openai_protocol import MAX_NUM_DRAFT_TOKENS
    from .server import serve

    if args.num_draft_tokens > MAX_NUM_DRAFT_TOKENS:  # what every request would then be refused for
        raise UserError(f"--num-draft-tokens must be at most {MAX_NUM_DRAFT_TOKENS} (the server's cap per request), "
                        f"got {args.num_draft_tokens}")
    _check_bind(args.host, args.port)
    serve(args.model, host=args.host, port=args.port, config=_config(args), max_waiting=args.max_waiting,
          concurrency=args.concurrency, draft_model=args.draft_model, device=args.device, dtype=args.dtype,
          api_key=args.api_key, request_timeout=args.request_timeout, max_body_bytes=args.max_body_bytes,
          drain_timeout=args.drain_timeout, max_batch=args.max_batch, seq_ctx=args.seq_ctx, max_rows=args.max_rows,
          **_backend_args(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (choices such as ``--tool-format`` read from their tables now)."""
    ap = argparse.ArgumentParser(prog="python -m agent", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="three example tools, three prompts, on the default model")
    _common(p)
    p.add_argument("--tool-choice", default="auto", type=tool_choice_arg,
                   help='auto | required | none | \'{"name": "TOOL"}\' (first turn)')
    p.set_defaults(fn=cmd_demo, max_new_tokens=96)
    p = sub.add_parser("run", help="run your own tools: --tools MODULE:OBJ 'prompt'")
    _common(p)
    p.add_argument("--tools", required=True)
    p.add_argument("--tool-choice", default="auto", type=tool_choice_arg,
                   help='auto | required | none | \'{"name": "TOOL"}\' (first turn)')
    p.add_argument("prompt")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("bfcl", help="BFCL questions; prints ID, VALID, CORRECT, OUTPUT and a JSON summary")
    _common(p)
    p.add_argument("--category", default="simple_python",
                   help="a BFCL category, several joined by commas, or 'all' (prints a per-category table)")
    p.add_argument("--split", default="dev", choices=("dev", "test"),
                   help="dev = first half of each file (tune here only); test = second half (only measured)")
    p.add_argument("--limit", type=_at_least(1), default=None, help="the first N questions of each category")
    p.add_argument("--data-dir", default=None, help="folder with *BFCL_v4_<category>* JSON-lines files")
    p.add_argument("--max-string-length", type=int, default=None,  # None: bench.bfcl.MAX_STRING_LENGTH
                   help="grammar cap on unbounded argument strings (chars); keeps every call within the budget")
    p.add_argument("--max-decimals", type=_count_or_none("decimals", 0), default="none",
                   help="grammar bound on numbers: N decimals, no exponent, |x| <= 1e15; 'none' (default, as the "
                        "Agent's): unbounded (llguidance admits an exponent only in an unbounded number)")
    p.add_argument("--max-items", type=_count_or_none("items", 1), default=None,  # None: bench.bfcl.MAX_ITEMS
                   help="grammar cap on the items of arrays that set no maxItems (default 32); 'none': no cap")
    p.add_argument("--runtime", default="ours",
                   help="ours (grammar-constrained) | parse-only (free generation, then vLLM's hermes parser or the "
                        "format's own) | ours,parse-only (both, one table)")
    p.set_defaults(fn=cmd_bfcl, max_new_tokens=384)
    p = sub.add_parser("serve", help="OpenAI-compatible server: POST /v1/chat/completions, GET /v1/models, /metrics, "
                                     "/health", description="Limits: num_draft_tokens <= 32 per request; seed 64 "
                       "bits; a prompt beyond the model's context gets 400; a client that disconnects stops its "
                       "decode. See agent/server.py.")
    _common(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-waiting", type=_at_least(0), default=64,
                   help="requests that may wait, streamed or not; more get HTTP 429 with Retry-After")
    p.add_argument("--concurrency", type=_at_least(1), default=1, help="decodes at once over the one model (threads)")
    p.add_argument("--max-batch", type=_at_least(1), default=None,
                   help="llama.cpp backend: continuous batching of up to N requests (one llama_decode per step for "
                        "all; replaces --concurrency)")
    p.add_argument("--seq-ctx", type=_at_least(1), default=None,
                   help="with --max-batch: KV positions per request (default 2048; the context holds N times that)")
    p.add_argument("--max-rows", type=_at_least(1), default=None,
                   help="with --max-batch: tokens per step's llama_decode, all requests together (default 128)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: env "
                        "SPECAGENT_API_KEY; none: no check, and a warning when --host is not loopback)")
    p.add_argument("--request-timeout", type=_at_least(0, float, strictly=True), default=None,
                   help="seconds per request from admission; then its decode stops and it gets 504 (default: none)")
    p.add_argument("--max-body-bytes", type=_at_least(1), default=4 * 1024 * 1024, help="larger request bodies get 413")
    p.add_argument("--drain-timeout", type=_at_least(0, float), default=30.0,
                   help="on SIGTERM: new requests get 503; in-flight ones get this many seconds to finish")
    p.add_argument("--max-string-length", type=int, default=None, help="default grammar cap on unbounded strings")
    p.add_argument("--max-decimals", type=int, default=None, help="default grammar bound on numbers")
    p.add_argument("--max-items", type=int, default=None, help="default grammar cap on the items of unbounded arrays")
    p.set_defaults(fn=cmd_serve)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _backend_args(args)  # conflicting or bad backend flags fail before anything loads
        return args.fn(args)
    except BrokenPipeError:  # the reader left (`... | head`): quiet, as Python's docs advise (signal.SIGPIPE notes)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush of stdout must not fail again
        return 141
    except (SpecAgentError, ValueError, OSError) as e:  # user errors (bad tools, model, choice, prompt, a file that
        print(f"error: {e}", file=sys.stderr)          # is missing or unreadable, a drafter's MTP head): one line
        return 2
    except KeyboardInterrupt:  # Ctrl-C: no traceback, the shell's status for SIGINT
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
