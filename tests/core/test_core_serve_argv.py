"""`serve_argv`, the one builder of `reinforge serve` command lines, against the real parser."""

import sys

from reinforge.cli import build_parser
from reinforge.rollout.command import serve_argv


def parsed(argv: list[str]):
    assert argv[:4] == [sys.executable, "-P", "-m", "reinforge"]
    return build_parser().parse_args(argv[4:])


def test_every_flag_it_writes_is_one_the_serve_command_reads():
    args = parsed(serve_argv("m/dir", port=8123, port_file="/tmp/p", weight_version=7,
                             kv_cache_dtype="int4", extra=["--page-size", "32"]))
    assert (args.command, args.model, args.port, args.port_file) == ("serve", "m/dir", 8123, "/tmp/p")
    assert (args.weight_version, args.kv_cache_dtype, args.page_size) == ("7", "int4", 32)


def test_unset_options_keep_the_server_defaults():
    args = parsed(serve_argv("m/dir"))
    assert (args.port, args.port_file, args.weight_version, args.kv_cache_dtype) == (
        0, None, "default", "int8")
