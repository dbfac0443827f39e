"""The `flashtune` command: one click group; each verb group lives in its own cli_*.py module."""
from __future__ import annotations

import click

from .cli_bench import bench
from .cli_db import db, dispatch_group
from .cli_kernels import kernels
from .cli_search import search


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flashtune")
def main():
    """flashtune: autotuned FlashAttention-2 kernels generated in Triton."""


main.add_command(kernels)
main.add_command(search)
main.add_command(db)
main.add_command(dispatch_group)
main.add_command(bench)

if __name__ == "__main__":
    main()
