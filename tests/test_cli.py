"""The click tree as a whole: every option says what it is for, command lists are not cut."""
import click
import pytest
from click.testing import CliRunner

from flashtune.cli import main


def _commands(group, path=("flashtune",)):
    for name, cmd in group.commands.items():
        yield (*path, name), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))


@pytest.mark.parametrize("path,cmd", list(_commands(main)), ids=lambda x: " ".join(x)
                         if isinstance(x, tuple) else "")
def test_every_option_has_help(path, cmd):
    lacking = [p.opts[0] for p in cmd.params
               if isinstance(p, click.Option) and not p.hidden and not p.help]
    assert not lacking, f"{' '.join(path)}: {lacking} have no help"


@pytest.mark.parametrize("args", [[], ["db"], ["dispatch"]])
def test_command_lists_are_not_cut(args):
    res = CliRunner().invoke(main, args + ["--help"], terminal_width=80)
    assert res.exit_code == 0
    listed = res.output.split("Commands:")[1]
    assert "..." not in listed, res.output


def test_search_help_explains_progress_format_and_head_dim():
    out = CliRunner().invoke(main, ["search", "--help"], terminal_width=100).output
    for opt, words in (("--progress", "bars"), ("--format", "JSON"), ("--head-dim", "16..256"),
                       ("--dtype", "bf16")):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(opt))
        assert words in out[out.index(line):out.index(line) + 300], opt
