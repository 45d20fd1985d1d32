"""The command line's parsing: server commands and client commands side by side."""

from app.cli import build_parser


def test_connection_options_before_a_nested_command_are_kept() -> None:
    parser = build_parser()
    args = parser.parse_args(["datasets", "--url", "http://gpu-box:8000", "--json", "upload", "photos"])
    assert (args.url, args.json, args.path) == ("http://gpu-box:8000", True, "photos")
    args = parser.parse_args(["datasets", "upload", "photos", "--url", "http://other:1"])
    assert args.url == "http://other:1" and args.json is False


def test_server_commands_parse() -> None:
    parser = build_parser()
    assert parser.parse_args(["worker", "--device", "1"]).device == "1"
    assert parser.parse_args(["up"]).command == "up"
