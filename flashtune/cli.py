"""The `flashtune` command: one click group; each verb group lives in its own cli_*.py module."""
from __future__ import annotations

import os
import sys

from .isolation import start_server


def _search_starts_early(argv: list[str]) -> bool:
    """`flashtune search` (not --dry-run, --status or --help) starts its workers' server before
    the imports below: the server imports torch while this process does, where it began after
    them (3-4 s of every search's start-up on the H100s; docs/benchmarks.md, session 17)."""
    return (bool(argv) and argv[0] == "search"
            and not {"--dry-run", "--status", "-h", "--help"} & set(argv))


if _search_starts_early(sys.argv[1:]):
    start_server()

import click  # noqa: E402 -- after the server's start

from .cli_bench import bench  # noqa: E402
from .cli_db import db, dispatch_group  # noqa: E402
from .cli_kernels import kernels  # noqa: E402
from .cli_search import search  # noqa: E402


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flashtune")
def main():
    """flashtune: autotuned FlashAttention-2 kernels generated in Triton."""


main.add_command(kernels)
main.add_command(search)
main.add_command(db)
main.add_command(dispatch_group)
main.add_command(bench)

def entry() -> None:
    """The `flashtune` program. A search that wrote its summary leaves without the interpreter's
    teardown (finalizers, the workers' server and resource tracker shut down one by one): its
    trials, winners and output are stored and flushed by then, and the teardown took ~0.5 s
    here and ~1 s of every `--gpus` search on the H200s (session 21). Anything else exits as
    usual."""
    try:
        main()
    except SystemExit as e:
        from .cli_search import search_finished
        if not search_finished():
            raise
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    entry()
